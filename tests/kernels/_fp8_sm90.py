"""Subprocess helper (TRITON_INTERPRET=0): compile the block-FP8 and per-token FP8 variants of
both paths for sm_90 on CPU (moe_serve.kernels.moe.aot) and print one JSON line per compiled kernel: the
variant, kernel, its MMA instruction (SASS), shared memory, constexpr modes and PDL use. A
variant named *-chained is launched with the block chained (MOE_SERVE_BLOCK_PDL=1)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe  # noqa: E402
from moe_serve.kernels.moe.launch import BLOCK_PDL_ENV, record_launches  # noqa: E402

FP8 = torch.float8_e4m3fn
E, N, K, TOPK, M = 8, 256, 512, 8, 4


def _decode(bn: int, swap: bool, pre: bool, down_swap: bool) -> dict:
    return {"DECODE": True, "PDL": True, "BLOCK_M": 32, "BLOCK_N": bn, "BLOCK_K": 128,
            "GROUP_M": 1, "num_warps": 4, "num_stages": 4, "SWAP_AB": swap, "A_PREQUANT": pre,
            "DOWN": {"BLOCK_N": 64 if down_swap else 32, "BLOCK_K": 128, "GROUP_M": 1,
                     "num_warps": 4, "num_stages": 4, "SWAP_AB": down_swap}}


def _aligned(bn: int, swap: bool, pre: bool, split: int = 1) -> dict:
    cfg = {"BLOCK_M": 16 if swap else 64, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 1,
           "num_warps": 4, "num_stages": 3, "SWAP_AB": swap, "A_PREQUANT": pre,
           "DOWN": {"BLOCK_N": 128, "BLOCK_K": 128, "SWAP_AB": swap, "SPLIT_K": split}}
    if split > 1:
        cfg.update(SPLIT_K=split, FUSE_GU=False)
    return cfg


VARIANTS = {  # name: (format, x fp8 (as vLLM hands it over), config)
    "block-decode-inloop": ("block", False, _decode(32, False, False, True)),
    "block-decode-swap-epiquant": ("block", True, _decode(128, True, False, True)),
    "block-aligned-swap-prequant": ("block", False, _aligned(128, True, True)),
    "block-aligned-wide-inloop": ("block", False, _aligned(64, False, False)),
    "block-aligned-split": ("block", True, _aligned(64, True, True, split=2)),
    "token-decode": ("token", True, _decode(64, True, False, True)),
    "token-decode-chained": ("token", True, _decode(64, True, False, True)),
    "token-aligned-prequant": ("token", False, _aligned(128, True, True)),
}


def launches_of(fmt: str, x_fp8: bool, cfg: dict) -> list:
    x = torch.empty(M, K, dtype=FP8 if x_fp8 else torch.bfloat16)
    w1, w2 = torch.empty(E, 2 * N, K, dtype=FP8), torch.empty(E, K, N, dtype=FP8)
    tw, ids = torch.empty(M, TOPK), (torch.arange(M * TOPK) % E).reshape(M, TOPK).int()
    if fmt == "block":
        a1 = torch.ones(M, K // 128) if x_fp8 else None
        scales = Fp8Scales(torch.ones(E, 2 * N // 128, K // 128), torch.ones(E, K // 128, N // 128),
                           a1, block_shape=(128, 128))
    else:
        scales = Fp8Scales(torch.ones(E, 2 * N), torch.ones(E, K),
                           torch.ones(M, 1) if x_fp8 else None, per_token_act=True)
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, fp8=scales, config=cfg)
    return launches


if __name__ == "__main__":
    cache: dict = {}
    for name, (fmt, x_fp8, cfg) in VARIANTS.items():
        with mock.patch.dict(os.environ, {BLOCK_PDL_ENV: "1" if name.endswith("-chained") else "0"}):
            launches = launches_of(fmt, x_fp8, cfg)
        for (kname, ck), (_, _, _, kw) in zip(aot.compile_launches(launches, cache=cache), launches):
            print(json.dumps({"variant": name, "kernel": kname, "mma": aot.mma_kind(aot.sass(ck)),
                              "smem": int(ck.metadata.shared), "swap": kw.get("SWAP_AB"),
                              "a_mode": kw.get("A_MODE"), "w_scale": kw.get("W_SCALE"),
                              "c_quant": kw.get("C_QUANT"), "scale": kw.get("SCALE"),
                              "launch_pdl": bool(kw.get("launch_pdl")),
                              "gdc_wait": "griddepcontrol.wait" in ck.asm["ptx"],
                              "gdc_launch": "griddepcontrol.launch_dependents" in ck.asm["ptx"]}),
                  flush=True)
