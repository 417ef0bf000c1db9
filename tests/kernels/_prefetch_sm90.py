"""Subprocess helper (TRITON_INTERPRET=0): compile the decode path's up kernel for sm_90 on CPU
(moe_serve.kernels.moe.aot) with each PREFETCH mode, bf16 and block FP8, and print one JSON line per
variant: the bulk L2 prefetches in its PTX and whether the first one comes before the first MMA."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402

E, N, K, TOPK, M = 8, 256, 512, 8, 1
PREFETCH = "cp.async.bulk.prefetch.L2.global"


def up_launch(fmt: str, mode: int) -> list:
    cfg = {"DECODE": True, "PDL": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
           "num_warps": 4, "num_stages": 3, "SWAP_AB": True, "PREFETCH": mode,
           "DOWN": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
                    "num_stages": 3, "SWAP_AB": True}}
    wdt = torch.float8_e4m3fn if fmt == "block" else torch.bfloat16
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w1, w2 = torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt)
    tw, ids = torch.empty(M, TOPK), (torch.arange(M * TOPK) % E).reshape(M, TOPK).int()
    fp8 = (Fp8Scales(torch.ones(E, 2 * N // 128, K // 128), torch.ones(E, K // 128, N // 128),
                     None, block_shape=(128, 128)) if fmt == "block" else None)
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, fp8=fp8, config=cfg)
    return [ln for ln in launches if ln[0].fn.__name__ == "moe_decode_up_kernel"]


if __name__ == "__main__":
    cache: dict = {}
    for fmt in ("bf16", "block"):
        for mode in (0, 1, 2):
            launches = up_launch(fmt, mode)
            (_, ck), = aot.compile_launches(launches, cache=cache)
            ptx = ck.asm["ptx"]
            first_mma = ptx.find("wgmma.mma_async")
            first_pf = ptx.find(PREFETCH)
            print(json.dumps({"format": fmt, "mode": mode, "kw": launches[0][3]["PREFETCH"],
                              "prefetches": ptx.count(PREFETCH), "mma": first_mma >= 0,
                              "before_mma": 0 <= first_pf < first_mma}), flush=True)
