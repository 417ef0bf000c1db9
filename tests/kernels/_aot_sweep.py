"""Subprocess helper (TRITON_INTERPRET=0): compile our MoE kernels for sm_90 on CPU while M
sweeps, print the jit_monitor snapshot as JSON. argv: M values after warm-up at argv[1]."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.plugin import jit_monitor  # noqa: E402
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402


def run(M: int, fmt: str) -> None:
    """fmt: bf16 | fp8 (dynamic, bf16 x) | fp8-block ([64, 64] blocks, fp8 x with group scales)."""
    E, N, K, topk = 4, 64, 64, 2
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3,
               SWAP_AB=True)
    wdt = torch.float8_e4m3fn if fmt != "bf16" else torch.bfloat16
    x = torch.empty(M, K, dtype=torch.float8_e4m3fn if fmt == "fp8-block" else torch.bfloat16)
    w1, w2 = torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt)
    tw, ids = torch.empty(M, topk), torch.zeros(M, topk, dtype=torch.int32)
    scales = {"bf16": None, "fp8": Fp8Scales(torch.ones(E), torch.ones(E, K)),
              "fp8-block": Fp8Scales(torch.ones(E, 2, 1), torch.ones(E, 1, 1), torch.ones(M, 1),
                                     block_shape=(64, 64))}[fmt]
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, fp8=scales, config=cfg)
    aot.compile_launches(launches)


if __name__ == "__main__":
    fp8 = sys.argv[1]
    ms = [int(v) for v in sys.argv[2:]]
    jit_monitor.install()
    jit_monitor.set_phase("warmup")
    run(ms[0], fp8)
    jit_monitor.set_phase("serving")
    for m in ms[1:]:
        run(m, fp8)
    snap = {"|".join(k): v for k, v in jit_monitor.snapshot().items()}
    print(json.dumps(snap))
