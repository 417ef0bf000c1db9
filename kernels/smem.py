"""Shared-memory budget of moe_gemm_kernel launches on Hopper (sm_90: 232448 B per CTA).

Triton's software pipeliner keeps `num_stages` copies of every tile loaded in the K loop in
shared memory, and wgmma reads operands from shared memory, so one program of the grouped
GEMM needs about

    num_stages * (A tile as loaded + weight tile(s)) + one A operand tile in the MMA dtype

A tile as loaded: BLOCK_M x BLOCK_K x itemsize(A) (x2 with A_SILU: gate and up halves of the
fp32 pre-activation h); weight tiles: BLOCK_N x BLOCK_K x itemsize(W) (x2 when GATE_UP: gate
and up rows). The extra operand tile covers the register -> shared copy of A after its in-loop
conversion (fp8 quantization, SiLU, transpose for swap-AB). The epilogue's layout conversions
reuse the (dead) pipeline buffers.

`estimate()` is checked to be an upper bound of Triton's own figure (CompiledKernel
metadata.shared) by compiling sampled configs for sm_90 on the CPU (kernels.aot):
``python -m kernels.smem --samples 40`` (and tests/kernels/test_smem_fit.py). `fit()` lowers
num_stages (to 2), then BLOCK_K (to 32... 16), until a config fits; configs.get_config applies
it to every config it returns (tuned file or heuristic).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

SMEM_LIMIT = 232448  # bytes per CTA on sm_90 (227 KB), cudaDevAttrMaxSharedMemoryPerBlockOptin
MIN_STAGES = 2


def estimate(BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, num_stages: int, a_bytes: int,
             w_bytes: int, gate_up: bool, a_silu: bool = False) -> int:
    """Upper bound of one moe_gemm_kernel program's shared memory in bytes.

    a_bytes: itemsize of A as loaded (bf16 2, fp32 h 4, fp8 input 1); w_bytes: weight
    itemsize (the MMA dtype: fp8 1, bf16 2, fp32 4); gate_up: GEMM1 fused gate+up (two
    weight tiles); a_silu: GEMM2 loading the fp32 h pre-activation (two A tiles)."""
    a_load = BLOCK_M * BLOCK_K * a_bytes * (2 if a_silu else 1)
    w = BLOCK_N * BLOCK_K * w_bytes * (2 if gate_up else 1)
    operand = BLOCK_M * BLOCK_K * max(w_bytes, 2 if w_bytes == 1 else w_bytes)
    return num_stages * (a_load + w) + operand


def launch_params(dtype: str, act_bytes: int = 2) -> dict[str, Any]:
    """Itemsizes for a weight dtype key ('bf16', 'fp16', 'fp32', 'fp8'); act_bytes is the
    hidden-state itemsize (bf16 2; fp8 input 1; fp32 4)."""
    w = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    return {"w_bytes": w, "act_bytes": act_bytes if dtype == "fp8" else w}


def gemm_estimates(cfg: dict[str, Any], dtype: str, act_bytes: int = 2) -> tuple[int, int]:
    """(GEMM1, GEMM2) estimates of a full config (configs.validate form, with DOWN)."""
    from kernels import configs

    p = launch_params(dtype, act_bytes)
    fused1 = cfg.get("SPLIT_K", 1) == 1 and cfg.get("FUSE_GU", True)
    g1 = estimate(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"],
                  p["act_bytes"], p["w_bytes"], bool(cfg.get("FUSE_GU", True)))
    d = configs.down_config(cfg)
    # GEMM2's A: act (out dtype: 2 bytes for fp8/bf16, 4 for fp32) or the fp32 h (A_SILU)
    a2 = 4 if not fused1 else (4 if dtype == "fp32" else 2)
    g2 = estimate(d["BLOCK_M"], d["BLOCK_N"], d["BLOCK_K"], d["num_stages"], a2, p["w_bytes"],
                  False, a_silu=not fused1)
    return g1, g2


def _fit_one(c: dict[str, Any], est) -> dict[str, Any]:
    c = dict(c)
    while est(c) > SMEM_LIMIT:
        if c["num_stages"] > MIN_STAGES:
            c["num_stages"] -= 1
        elif c["BLOCK_K"] > 32:
            c["BLOCK_K"] //= 2
        elif c["BLOCK_N"] > 64 or (not c["SWAP_AB"] and c["BLOCK_N"] > 16):
            c["BLOCK_N"] //= 2
        else:
            raise ValueError(f"no shared-memory fit for {c}")
    return c


def fit(cfg: dict[str, Any], dtype: str, act_bytes: int = 2) -> dict[str, Any]:
    """cfg with num_stages, then BLOCK_K (then BLOCK_N) reduced until both GEMMs' estimates
    are <= SMEM_LIMIT. Unchanged (same dict values) when it already fits."""
    from kernels import configs

    p = launch_params(dtype, act_bytes)
    fused1 = cfg.get("SPLIT_K", 1) == 1 and cfg.get("FUSE_GU", True)
    g1 = _fit_one({k: cfg[k] for k in cfg if k != "DOWN"}, lambda c: estimate(
        c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], p["act_bytes"], p["w_bytes"],
        bool(c.get("FUSE_GU", True))))
    a2 = 4 if not fused1 else (4 if dtype == "fp32" else 2)
    d = _fit_one(configs.down_config(cfg), lambda c: estimate(
        c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], a2, p["w_bytes"], False,
        a_silu=not fused1))
    g1["DOWN"] = {k: v for k, v in d.items() if k != "BLOCK_M"}
    return configs.validate(g1)


# ---------------------------------------------------------------------------- validation
def measure(cfg: dict[str, Any], dtype: str, static_act: bool = True, E: int = 8, N: int = 256,
            K: int = 512, topk: int = 2, M: int = 4) -> list[tuple[int, int]]:
    """[(estimate, Triton's metadata.shared)] of the GEMM launches of cfg, compiled for sm_90
    on the CPU (needs TRITON_INTERPRET unset)."""
    import torch

    from kernels import aot
    from kernels.fused_moe import Fp8Scales, fused_moe
    from kernels.launch import record_launches

    wdt = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w1, w2 = torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt)
    tw = torch.empty(M, topk)
    ids = (torch.arange(M * topk) % E).reshape(M, topk).to(torch.int32)
    one = torch.ones(())
    fp8 = Fp8Scales(torch.ones(E), torch.ones(E), one if static_act else None,
                    one if static_act else None) if dtype == "fp8" else None
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, fp8=fp8, config=cfg)
    gemms = [ln for ln in launches if ln[3].get("BLOCK_N") is not None and "GATE_UP" in ln[3]]
    est = gemm_estimates(cfg, dtype)
    out = []
    for (ln, e) in zip(gemms, est):
        (_, ck), = aot.compile_launches([ln], cache={})
        out.append((e, int(ck.metadata.shared)))
    return out


def sample_configs(n: int, seed: int = 0) -> list[tuple[dict[str, Any], str, bool]]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        bm = rng.choice((16, 32, 64, 128))
        swap = bm < 64 and rng.random() < 0.7
        bn = rng.choice((64, 128, 256) if swap else (16, 32, 64, 128, 256))
        dtype = rng.choice(("bf16", "fp8"))
        bk = rng.choice((64, 128, 256) if dtype == "fp8" else (32, 64, 128))
        split = rng.random() < 0.35 and bm < 64
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4 if bm <= 64 else 8,
                   num_stages=rng.choice((2, 3, 4, 5)), SWAP_AB=swap,
                   SPLIT_K=rng.choice((1, 2)) if split else 1, FUSE_GU=not split,
                   DOWN=dict(BLOCK_N=rng.choice((64, 128)), BLOCK_K=min(bk, 128),
                             num_stages=rng.choice((2, 3, 4)), SWAP_AB=swap))
        out.append((cfg, dtype, rng.random() < 0.5))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="check estimate() >= Triton's metadata.shared")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows, bad = [], 0
    for cfg, dtype, static in sample_configs(args.samples, args.seed):
        try:
            pairs = measure(cfg, dtype, static)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"cfg": cfg, "dtype": dtype, "error": repr(e)[:200]}), flush=True)
            continue
        for gemm, (est, real) in zip(("gemm1", "gemm2"), pairs):
            ok = est >= real
            bad += not ok
            row = {"gemm": gemm, "dtype": dtype, "static": static, "est": est, "shared": real,
                   "ratio": round(est / max(real, 1), 3), "ok": ok,
                   "cfg": {k: v for k, v in cfg.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"summary": {"n": len(rows), "not_upper_bound": bad}}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
