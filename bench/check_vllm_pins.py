"""Run kernels/plugin/vllm_pins.py's pins on this host's vLLM (the GPU host's 0.26; the CPU tests run
them on 0.32) and print one JSON line per pin, then a summary; exit 1 if any pin fails.

    python bench/check_vllm_pins.py            # needs only `import vllm` to work (no GPU set-up)
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_serve.kernels.plugin import vllm_pins  # noqa: E402


def main() -> int:
    failed = 0
    for pin in vllm_pins.PINS:
        try:
            print(json.dumps({"pin": pin.__name__, "ok": True, "checked": pin()}), flush=True)
        except Exception as exc:  # noqa: BLE001 - report every pin, not just the first failure
            failed += 1
            print(json.dumps({"pin": pin.__name__, "ok": False, "error": repr(exc),
                              "where": traceback.format_exc(limit=-2)}), flush=True)
    print(json.dumps({"vllm": vllm_pins.vllm.__version__, "pins": len(vllm_pins.PINS), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
