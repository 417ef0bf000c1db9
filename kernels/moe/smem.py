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

The decode path (moe_serve.kernels.moe.moe_decode) keeps, per stage, the [BLOCK_M, BK] A tile plus two
(up kernel) or one (down kernel) weight tiles; its GEMV form (moe_serve.kernels.moe.moe_gemv) keeps its
tiles in registers and needs shared memory only for reductions (gemv_estimate).

The estimates are checked to be upper bounds of Triton's own figure (CompiledKernel
metadata.shared) by compiling configs for sm_90 on the CPU (tests/kernels/test_smem_fit.py).
`fit()` lowers num_stages (to 2), then BLOCK_K (to 32), then BLOCK_N, until a config fits;
moe_serve.kernels.moe.selection applies it to every config it chooses (tuned file or heuristic) and
records what it changed.
"""
from __future__ import annotations

from typing import Any

from moe_serve.kernels.moe.config_schema import down_config, validate

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


def gemm_estimates(cfg: dict[str, Any], dtype: str, act_bytes: int = 2,
                   topk: int = 8) -> tuple[int, int]:
    """(GEMM1, GEMM2) estimates of a full config (config_schema.validate form, with DOWN);
    topk sizes the decode down kernel's A tile (rows = next power of two >= max(16, topk))."""
    p = launch_params(dtype, act_bytes)
    d = down_config(cfg)
    if cfg.get("GEMV"):
        return gemv_estimate(cfg), gemv_estimate(d)
    if cfg.get("DECODE"):
        a2 = max(p["w_bytes"], 2)     # act: the out dtype (bf16, fp32), or fp8 (1 B; bound 2)
        rows2 = max(16, 1 << (topk - 1).bit_length())
        return (estimate(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"],
                         p["act_bytes"], p["w_bytes"], True),
                estimate(rows2, d["BLOCK_N"], d["BLOCK_K"], d["num_stages"], a2,
                         p["w_bytes"], False))
    fused1 = cfg.get("SPLIT_K", 1) == 1 and cfg.get("FUSE_GU", True)
    g1 = estimate(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"],
                  p["act_bytes"], p["w_bytes"], bool(cfg.get("FUSE_GU", True)))
    # GEMM2's A: act (out dtype: 2 bytes for fp8/bf16, 4 for fp32) or the fp32 h (A_SILU)
    a2 = 4 if not fused1 else (4 if dtype == "fp32" else 2)
    g2 = estimate(d["BLOCK_M"], d["BLOCK_N"], d["BLOCK_K"], d["num_stages"], a2, p["w_bytes"],
                  False, a_silu=not fused1)
    return g1, g2


def gemv_estimate(c: dict[str, Any]) -> int:
    """Upper bound of one GEMV program's shared memory (moe_serve.kernels.moe.moe_gemv): no pipeline, the
    weight tile lives in registers; only tl.sum's cross-warp reduction of [BLOCK_N] fp32 partial
    sums (two: gate and up) and the layout change of the [BLOCK_K] activation chunk use it."""
    return 2 * c["BLOCK_N"] * c["num_warps"] * 4 + c["BLOCK_K"] * 4


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


def fit(cfg: dict[str, Any], dtype: str, act_bytes: int = 2, topk: int = 8) -> dict[str, Any]:
    """cfg with num_stages, then BLOCK_K (then BLOCK_N) reduced until both GEMMs' estimates
    are <= SMEM_LIMIT. Unchanged (same dict values) when it already fits."""
    top = {k: cfg[k] for k in cfg if k != "DOWN"}
    down = {k: v for k, v in down_config(cfg).items() if k != "BLOCK_M"}

    def full(g: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
        return {**g, "DOWN": d}

    g1 = _fit_one(top, lambda c: gemm_estimates(full(c, down), dtype, act_bytes, topk)[0])
    d = _fit_one({**down, "BLOCK_M": g1["BLOCK_M"]},
                 lambda c: gemm_estimates(full(g1, {k: v for k, v in c.items() if k != "BLOCK_M"}),
                                          dtype, act_bytes, topk)[1])
    return validate(full(g1, {k: v for k, v in d.items() if k != "BLOCK_M"}))
