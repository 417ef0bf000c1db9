"""Launcher of the fused MoE: align -> GEMM1 (+SiLU-and-mul) -> GEMM2 (+routed weight) -> top-k sum,
or, for few tokens (a DECODE config), moe_serve.kernels.moe.moe_decode's two launches (split-K or not:
moe_serve.kernels.moe.moe_decode_launch), or their CUDA-core GEMV form (a GEMV config:
moe_serve.kernels.moe.moe_gemv_launch).

Fused path (SPLIT_K 1, FUSE_GU): four launches (three when topk == 1).
Split / un-fused path (decode: more programs streaming weights):
    align, one zero-fill of an fp32 workspace (only when a SPLIT_K > 1),
    GEMM1 -> h [T, 2N] fp32 pre-activation (atomic partials when its SPLIT_K > 1),
    GEMM2 with SiLU-and-mul applied on loading h (A_SILU) -> fp32 [M, K] atomically
    (SPLIT_K > 1; rows = token, so the top-k reduction rides on the atomics) or c [T, K],
    top-k sum / fp32 -> out dtype conversion.  = 5 launches at most.
FP8 with float hidden states and A_PREQUANT (this path's default) adds one quantize-once launch
before GEMM1, and one before GEMM2 for a dynamic act that GEMM1's epilogue cannot quantize
(per token; block groups wider than its tile): moe_serve.kernels.moe.fp8_scales.
No host sync, every buffer sized from shapes only: CUDA-graph capturable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from moe_serve.kernels.moe import configs, fp8_scales, selection, smem
from moe_serve.kernels.moe.align import max_padded_len, moe_align
from moe_serve.kernels.moe.config_schema import block_k_fits, block_k_of, prequant
from moe_serve.kernels.moe.fp8_scales import FP8, INTERPRET, Fp8Scales, block_stride, scale_strides
from moe_serve.kernels.moe.launch import launch
from moe_serve.kernels.moe.moe_decode_launch import fused_moe_decode
from moe_serve.kernels.moe.moe_gemv_launch import fused_moe_gemv
from moe_serve.kernels.moe.moe_gemm import moe_gemm_kernel, topk_sum_kernel

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", FP8: "fp8"}

__all__ = ["FP8", "Fp8Scales", "KernelConfigError", "dtype_name", "fused_moe", "num_programs"]


def dtype_name(w_dtype: torch.dtype) -> str:
    """Config-table dtype key of a weight dtype ('bf16', 'fp16', 'fp32', 'fp8')."""
    return _DTYPE_NAMES[w_dtype]


def format_of(w_dtype: torch.dtype, fp8: Fp8Scales | None) -> str:
    """The moe_serve.kernels.moe.quant_format key of a call (config tables, routing)."""
    return fp8.format if fp8 is not None else dtype_name(w_dtype)


@dataclass(frozen=True)
class _Operand:
    """One GEMM's A operand and scales as the kernel takes them (moe_serve.kernels.moe.moe_gemm modes)."""

    a: torch.Tensor
    a_scale: torch.Tensor | None
    a_mode: int
    w_scale: torch.Tensor | None
    w_mode: int


class KernelConfigError(RuntimeError):
    """A kernel config that cannot launch on this GPU (e.g. out of shared memory)."""


def _launch_gemm(op: _Operand, w: torch.Tensor, c: torch.Tensor, n_out: int, k_in: int,
                 topk_weights: torch.Tensor, align: tuple, num_valid: int, a_row_div: int,
                 gate_up: bool, epi: int, mul_routed: bool, cfg: dict[str, Any],
                 fp8: Fp8Scales | None, a_silu: bool = False, c_row_div: int = 1,
                 c_quant: int = 0, c_scale: torch.Tensor | None = None) -> None:
    sorted_ids, expert_ids, num_post = align
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    split_k = int(cfg.get("SPLIT_K", 1))
    num_m_blocks = expert_ids.numel()
    dummy = topk_weights  # any tensor for unused pointers
    ws = op.w_scale if op.w_scale is not None else dummy
    cs = c_scale if c_scale is not None else dummy
    se, sn, sk = block_stride(ws, op.w_mode)
    try:
        launch(
            moe_gemm_kernel, (num_m_blocks * triton.cdiv(n_out, bn), split_k),
            op.a, w, c, op.a_scale if op.a_scale is not None else dummy, ws, topk_weights,
            sorted_ids, expert_ids, num_post, cs,
            n_out, k_in, num_valid, num_m_blocks,
            op.a.stride(0), op.a.stride(1), w.stride(0), w.stride(1), w.stride(2),
            c.stride(0), c.stride(1), se, sn,
            *scale_strides(op.a_scale), sk, *(scale_strides(c_scale) if c_quant == 2 else (0, 0)),
            A_ROW_DIV=a_row_div, GATE_UP=gate_up, EPI=epi, MUL_ROUTED=mul_routed,
            A_MODE=op.a_mode, W_SCALE=op.w_mode, EVEN_K=k_in % cfg["BLOCK_K"] == 0,
            SWAP_AB=cfg["SWAP_AB"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"],
            GROUP_M=cfg["GROUP_M"], FP8_PREROUND=INTERPRET and (op.a_mode in (2, 3, 6) or c_quant > 0),
            SPLIT_K=split_k, A_SILU=a_silu, C_ROW_DIV=c_row_div,
            GROUP_N=fp8.group_n if fp8 else 0, GROUP_K=fp8.group_k if fp8 else 0, C_QUANT=c_quant,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    except Exception as exc:
        if type(exc).__name__ != "OutOfResources":
            raise
        est = smem.estimate(bm, bn, cfg["BLOCK_K"], cfg["num_stages"], op.a.element_size(),
                            w.element_size(), gate_up, a_silu)
        raise KernelConfigError(
            f"moe_gemm_kernel config {({k: cfg[k] for k in cfg if k != 'DOWN'})} (A {op.a.dtype}, "
            f"W {w.dtype} {tuple(w.shape)}) cannot launch: {exc} (moe_serve.kernels.moe.smem estimate {est} B, "
            f"limit {smem.SMEM_LIMIT} B). The MoE output is NOT valid; lower num_stages / "
            f"BLOCK_K in the config file or pass a smaller config.") from exc


def num_programs(M: int, E: int, N: int, K: int, topk: int, cfg: dict[str, Any]) -> tuple[int, int]:
    """(GEMM1, GEMM2) programs of a config that do work when every (token, expert) pair is
    a distinct expert (decode worst case for the block count: min(T, E) hit experts)."""
    T = M * topk
    down = configs.down_config(cfg)
    if cfg.get("GEMV"):                 # one program per slot, both kernels split
        return (T * -(-N // cfg["BLOCK_N"]) * int(cfg.get("SPLIT_K", 1)),
                M * -(-K // down["BLOCK_N"]) * int(down.get("SPLIT_K", 1)))
    if cfg.get("DECODE"):
        return min(T, E) * -(-N // cfg["BLOCK_N"]), M * -(-K // down["BLOCK_N"])
    blocks = -(-max_padded_len(T, E, cfg["BLOCK_M"]) // cfg["BLOCK_M"])
    rows1 = N if cfg.get("FUSE_GU", True) else 2 * N
    g1 = blocks * -(-rows1 // cfg["BLOCK_N"]) * int(cfg.get("SPLIT_K", 1))
    g2 = blocks * -(-K // down["BLOCK_N"]) * int(down.get("SPLIT_K", 1))
    return g1, g2


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, fp8: Fp8Scales | None = None,
              apply_router_weight_on_input: bool = False, out: torch.Tensor | None = None,
              config: dict[str, Any] | None = None) -> torch.Tensor:
    """MoE expert computation: out[m] = sum_j w_j * W2[e_j] (silu(W1g[e_j] x_m) * W1u[e_j] x_m).

    hidden_states [M, K] bf16/fp16/fp32 (or fp8 with its fp8.a1_scale); w1 [E, 2N, K] (gate rows
    0..N-1, up rows N..2N-1); w2 [E, K, N]; topk_weights [M, topk] float32; topk_ids [M, topk]
    int32/int64 (the decode path also takes -1: an expert not on this rank, contributing
    nothing). FP8 formats: moe_serve.kernels.moe.fp8_scales.Fp8Scales.
    Returns [M, K] in hidden_states' dtype (bf16 for fp8 input). `config` overrides the
    table/heuristic choice (tuner, tests).
    """
    if hidden_states.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError("expected hidden [M, K], w1 [E, 2N, K], w2 [E, K, N]")
    M, K = hidden_states.shape
    E, two_n, K1 = w1.shape
    N = two_n // 2
    if K1 != K or two_n % 2 or tuple(w2.shape) != (E, K, N):
        raise ValueError(f"shape mismatch: hidden {tuple(hidden_states.shape)}, "
                         f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [M={M}, topk]")
    topk = topk_ids.shape[1]
    if apply_router_weight_on_input and topk != 1:
        raise ValueError("apply_router_weight_on_input needs topk == 1")
    use_fp8 = fp8 is not None
    if use_fp8 != (w1.dtype == FP8) or w2.dtype != w1.dtype:
        raise TypeError(f"w1/w2 dtypes {w1.dtype}/{w2.dtype} and fp8={fp8 is not None} disagree")
    if not use_fp8 and hidden_states.dtype != w1.dtype:
        raise TypeError(f"hidden {hidden_states.dtype} != weights {w1.dtype}")
    out_dtype = torch.bfloat16 if hidden_states.dtype == FP8 else hidden_states.dtype
    if out is not None and (tuple(out.shape) != (M, K) or out.dtype != out_dtype):
        raise ValueError(f"out must be [{M}, {K}] {out_dtype}")
    if out is None:
        out = torch.empty((M, K), dtype=out_dtype, device=hidden_states.device)
    if M == 0:
        return out
    if use_fp8:
        fp8_scales.check(fp8, hidden_states, E, N, K)
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    topk_weights = topk_weights.contiguous()

    cfg = config or selection.get_config(M, E, N, K, topk, format_of(w1.dtype, fp8),
                                         act_bytes=hidden_states.element_size())
    if use_fp8 and fp8.block_shape and not block_k_fits(cfg, fp8.group_k):
        raise ValueError(f"block FP8 {fp8.block_shape} needs BLOCK_K == {fp8.group_k} in both "
                         f"GEMMs (a K step is one activation group; GEMV: a multiple of it), "
                         f"config has {block_k_of(cfg)}")
    if cfg.get("GEMV"):
        return fused_moe_gemv(hidden_states, w1, w2, topk_weights, topk_ids, fp8,
                              apply_router_weight_on_input, out, cfg)
    if cfg.get("DECODE"):
        return fused_moe_decode(hidden_states, w1, w2, topk_weights, topk_ids, fp8,
                                apply_router_weight_on_input, out, cfg)
    return _fused_moe_aligned(hidden_states, w1, w2, topk_weights, topk_ids, fp8,
                              apply_router_weight_on_input, out, cfg)


def _fused_moe_aligned(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tw: torch.Tensor,
                       ids: torch.Tensor, fp8: Fp8Scales | None, on_input: bool, out: torch.Tensor,
                       cfg: dict[str, Any]) -> torch.Tensor:
    """The aligned path (see the module doc); shapes checked by fused_moe."""
    M, K = x.shape
    E, N = w1.shape[0], w1.shape[1] // 2
    topk = ids.shape[1]
    T = M * topk
    dev = x.device
    down = configs.down_config(cfg)
    align = moe_align(ids, E, cfg["BLOCK_M"])
    w1s, w1_mode, w2s, w2_mode = fp8_scales.weight_scales(fp8, E, N, K)
    split1 = int(cfg.get("SPLIT_K", 1))
    split2 = int(down.get("SPLIT_K", 1))
    fused1 = split1 == 1 and cfg.get("FUSE_GU", True)
    pre = prequant(cfg)
    op1 = _Operand(*fp8_scales.gemm1_input(x, fp8, pre), w1s, w1_mode)
    # one fp32 workspace: [h (T x 2N) when GEMM1 is split/un-fused][c32 (M x K) when GEMM2 split]
    n_h = 0 if fused1 else T * 2 * N
    n_c = M * K if split2 > 1 else 0
    ws = None
    if n_h + n_c:
        ws = torch.empty(n_h + n_c, dtype=torch.float32, device=dev)
        if split1 > 1 or split2 > 1:
            ws.zero_()                                                 # one memset
    c_quant, a_mode2 = fp8_scales.gemm2_plan(fp8, cfg["BLOCK_N"] if fused1 else None)
    a2s = fp8.a2_scale if fp8 is not None else None
    if fused1:
        act = torch.empty((T, N), dtype=FP8 if c_quant else out.dtype, device=dev)   # [T, N]
        if c_quant == 2:
            a2s = torch.empty((T, triton.cdiv(N, fp8.group_k)), dtype=torch.float32, device=dev)
        _launch_gemm(op1, w1, act, N, K, tw, align, T, topk, True, 1, on_input, cfg, fp8,
                     c_quant=c_quant, c_scale=a2s)
        if pre and a_mode2 in (3, 6):             # dynamic act: quantized once, by one launch
            act, a2s = fp8_scales.quantize(act, 1 if a_mode2 == 3 else 2, group=fp8.group_k)
            a_mode2 = 4 if a_mode2 == 3 else 5
    else:
        act = ws[:n_h].view(T, 2 * N)                                 # h = [gate | up], fp32
        gate_up = bool(cfg.get("FUSE_GU", True))
        _launch_gemm(op1, w1, act, N if gate_up else 2 * N, K, tw, align, T, topk, gate_up,
                     2 if split1 > 1 else 0, on_input, cfg, fp8)
    op2 = _Operand(act, a2s, a_mode2, w2s, w2_mode)
    if split2 > 1:
        c32 = ws[n_h:].view(M, K)
        _launch_gemm(op2, w2, c32, K, N, tw, align, T, 1, False, 2, not on_input, down, fp8,
                     a_silu=not fused1, c_row_div=topk)
        _topk_sum(c32, out, 1)
        return out
    c2 = out if topk == 1 else torch.empty((T, K), dtype=out.dtype, device=dev)  # [T, K]
    _launch_gemm(op2, w2, c2, K, N, tw, align, T, 1, False, 0, not on_input, down, fp8,
                 a_silu=not fused1)
    if topk > 1:
        _topk_sum(c2, out, topk)
    return out


def _topk_sum(c: torch.Tensor, out: torch.Tensor, topk: int) -> None:
    """out[m] = sum of c's rows m * topk .. m * topk + topk - 1 (fp32 accumulation)."""
    M, K = out.shape
    bk = min(1024, triton.next_power_of_2(K))
    launch(topk_sum_kernel, (M, triton.cdiv(K, bk)),
           c, out, K, c.stride(0), out.stride(0), TOPK=topk, BLOCK_K=bk, num_warps=4)
