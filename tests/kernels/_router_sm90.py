"""Subprocess helper (TRITON_INTERPRET=0): compile the router's variants (kernels.moe.router_topk)
for sm_90 on CPU (kernels.moe.aot) and print one JSON line per compiled kernel."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels.moe import aot  # noqa: E402
from kernels.moe.launch import record_launches  # noqa: E402
from kernels.moe.router_topk import router_topk  # noqa: E402

VARIANTS = {  # name: (M, E, K, topk, scoring, bias)
    "qwen3-decode-split": (1, 128, 2048, 8, "softmax", False),
    "mixtral-decode-split": (4, 8, 4096, 2, "softmax", False),
    "deepseek-sigmoid-bias": (2, 256, 7168, 8, "sigmoid", True),
    "prefill-one-program": (512, 128, 2048, 8, "softmax", False),
    "kimi-one-program": (256, 384, 7168, 8, "sigmoid", True),
}

if __name__ == "__main__":
    cache: dict = {}
    for name, (M, E, K, topk, scoring, bias) in VARIANTS.items():
        x, w = torch.empty(M, K, dtype=torch.bfloat16), torch.empty(E, K, dtype=torch.bfloat16)
        with record_launches() as launches:
            router_topk(x, w, topk, scoring, bias=torch.zeros(E) if bias else None)
        for (kname, ck), (_, grid, _, kw) in zip(aot.compile_launches(launches, cache=cache), launches):
            print(json.dumps({"variant": name, "kernel": kname, "grid": list(grid),
                              "one_program": kw["ONE_PROGRAM"], "smem": int(ck.metadata.shared),
                              "launch_pdl": bool(kw.get("launch_pdl")),
                              "gdc": [i for i in ("griddepcontrol.launch_dependents", "griddepcontrol.wait")
                                      if i in ck.asm["ptx"]]}), flush=True)
