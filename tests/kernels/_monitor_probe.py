"""Subprocess helper (TRITON_INTERPRET=0; interpreted runs in the same process would leave
triton.language patched): compile a copy kernel for sm_90 on CPU under jit_monitor and print
{"snapshot": {...}, "events": [...]} as JSON. argv[1]: dns | nodns | cache."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.plugin import jit_monitor  # noqa: E402


def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def sweep(jf, ms) -> None:
    x = torch.zeros(64)
    with aot.fake_cuda():
        for m in ms:
            jf.warmup(x, x, m, BLOCK=64, grid=(1,))


if __name__ == "__main__":
    mode = sys.argv[1]
    events: list = []
    jit_monitor.install()
    jit_monitor.add_listener(lambda k, ph, kd, info: events.append(
        [k, ph, kd, sorted(info), str(info.get("signature"))]))
    jit_monitor.set_phase("warmup")
    dns = {"do_not_specialize": ["n"]} if mode != "nodns" else {}
    jf = aot.jit_function(_copy_kernel, **dns)
    sweep(jf, [7])
    if mode == "cache":  # fresh JITFunction: in-memory miss, on-disk hit
        sweep(aot.jit_function(_copy_kernel, **dns), [7])
    else:
        jit_monitor.set_phase("serving")
        sweep(jf, [1, 2, 16, 17, 32, 33, 48, 63, 64])
    print(json.dumps({"snapshot": {"|".join(k): v for k, v in jit_monitor.snapshot().items()},
                      "events": events}))
