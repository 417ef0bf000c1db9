"""Launcher of the fused MoE: align -> GEMM1 (+SiLU-and-mul) -> GEMM2 (+routed weight) -> top-k sum,
or, for few tokens (a DECODE config), kernels.moe.moe_decode's two launches (split-K or not).

Fused path (SPLIT_K 1, FUSE_GU): four launches (three when topk == 1).
Split / un-fused path (decode: more programs streaming weights):
    align, one zero-fill of an fp32 workspace (only when a SPLIT_K > 1),
    GEMM1 -> h [T, 2N] fp32 pre-activation (atomic partials when its SPLIT_K > 1),
    GEMM2 with SiLU-and-mul applied on loading h (A_SILU) -> fp32 [M, K] atomically
    (SPLIT_K > 1; rows = token, so the top-k reduction rides on the atomics) or c [T, K],
    top-k sum / fp32 -> out dtype conversion.  = 5 launches at most.
No host sync, every buffer sized from shapes only: CUDA-graph capturable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton

from kernels.moe import configs, smem
from kernels.moe.align import max_padded_len, moe_align
from kernels.moe.launch import launch
from kernels.moe.moe_decode import moe_decode_down_kernel, moe_decode_up_kernel
from kernels.moe.moe_gemm import moe_gemm_kernel, quant_fp8_kernel, topk_sum_kernel

FP8 = torch.float8_e4m3fn
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # see moe_gemm._quant_fp8
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", FP8: "fp8"}


@dataclass(frozen=True)
class Fp8Scales:
    """FP8 W8A8 scales (float32). w*_scale: per-tensor [E] or per-channel [E, 2N] (w1) /
    [E, K] (w2). a*_scale: static per-tensor scalar tensor, or None = dynamic per-token
    (row absmax / 448, computed inside the GEMM kernel)."""

    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    a1_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None


def dtype_name(w_dtype: torch.dtype) -> str:
    """Config-table dtype key of a weight dtype ('bf16', 'fp16', 'fp32', 'fp8')."""
    return _DTYPE_NAMES[w_dtype]


def _w_scale(scale: torch.Tensor, E: int, rows: int, what: str) -> tuple[torch.Tensor, int]:
    """Normalise a weight scale to [E, 1] (per-tensor, mode 1) or [E, rows] (mode 2)."""
    if scale.numel() == E:
        return scale.reshape(E, 1), 1
    if scale.numel() == E * rows:
        return scale.reshape(E, rows), 2
    raise ValueError(f"{what} must have E={E} (per-tensor) or E*{rows} (per-channel) elements, "
                     f"got shape {tuple(scale.shape)}")


def _scales(fp8: Fp8Scales | None, E: int, N: int, K: int) -> tuple:
    """(w1 scale, its mode, w2 scale, its mode, a1 scale, a2 scale); all None / 0 for bf16."""
    if fp8 is None:
        return None, 0, None, 0, None, None
    w1s, m1 = _w_scale(fp8.w1_scale, E, 2 * N, "w1_scale")
    w2s, m2 = _w_scale(fp8.w2_scale, E, K, "w2_scale")
    return w1s, m1, w2s, m2, fp8.a1_scale, fp8.a2_scale


def _a_mode(a_dtype: torch.dtype, a_scale: torch.Tensor | None, fp8: bool, what: str) -> int:
    if not fp8:
        return 0
    if a_dtype == FP8:
        if a_scale is None:
            raise ValueError(f"fp8 input needs a static {what}")
        return 1
    return 3 if a_scale is None else 2


def _launch_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, n_out: int, k_in: int,
                 a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, w_mode: int,
                 a_mode: int, topk_weights: torch.Tensor, align: tuple, num_valid: int,
                 a_row_div: int, gate_up: bool, epi: int, mul_routed: bool, cfg: dict[str, Any],
                 a_silu: bool = False, c_row_div: int = 1) -> None:
    sorted_ids, expert_ids, num_post = align
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    split_k = int(cfg.get("SPLIT_K", 1))
    num_m_blocks = expert_ids.numel()
    grid = (num_m_blocks * triton.cdiv(n_out, bn), split_k)
    dummy = topk_weights  # any tensor for unused pointers
    ws = w_scale if w_scale is not None else dummy
    try:
        _launch_checked(grid, cfg, a, w, c, a_scale, w_scale, w_mode, a_mode, topk_weights,
                        sorted_ids, expert_ids, num_post, n_out, k_in, num_valid, num_m_blocks,
                        a_row_div, gate_up, epi, mul_routed, split_k, a_silu, c_row_div, dummy, ws)
    except Exception as exc:
        if type(exc).__name__ != "OutOfResources":
            raise
        est = smem.estimate(bm, bn, cfg["BLOCK_K"], cfg["num_stages"], a.element_size(),
                            w.element_size(), gate_up, a_silu)
        raise KernelConfigError(
            f"moe_gemm_kernel config {({k: cfg[k] for k in cfg if k != 'DOWN'})} (A {a.dtype}, "
            f"W {w.dtype} {tuple(w.shape)}) cannot launch: {exc} (kernels.moe.smem estimate {est} B, "
            f"limit {smem.SMEM_LIMIT} B). The MoE output is NOT valid; lower num_stages / "
            f"BLOCK_K in the config file or pass a smaller config.") from exc


_SPLIT_WS: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[tuple[torch.Tensor, torch.Tensor]] = []  # a captured graph may still use them


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split_workspace(device: torch.device, n_floats: int, n_counters: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [>= n_floats], int32 [>= n_counters]) for the decode path's split-K reduction.

    Zero on allocation and zero again after every call (each tile's last program clears what
    it read), so a call needs no memset launch. One pair per device and stream, grown in powers
    of two; an outgrown pair is kept alive, since a captured CUDA graph holds its pointers."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    have = _SPLIT_WS.get(key)
    if have is not None and have[0].numel() >= n_floats and have[1].numel() >= n_counters:
        return have
    fl, ct = _pow2_at_least(n_floats), _pow2_at_least(n_counters)
    if have is not None:
        _OUTGROWN.append(have)
        fl, ct = max(fl, have[0].numel()), max(ct, have[1].numel())
    _SPLIT_WS[key] = (torch.zeros(fl, dtype=torch.float32, device=device),
                      torch.zeros(ct, dtype=torch.int32, device=device))
    return _SPLIT_WS[key]


class KernelConfigError(RuntimeError):
    """A kernel config that cannot launch on this GPU (e.g. out of shared memory)."""


def _launch_checked(grid, cfg, a, w, c, a_scale, w_scale, w_mode, a_mode, topk_weights,
                    sorted_ids, expert_ids, num_post, n_out, k_in, num_valid, num_m_blocks,
                    a_row_div, gate_up, epi, mul_routed, split_k, a_silu, c_row_div, dummy, ws):
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    launch(
        moe_gemm_kernel, grid, a, w, c, a_scale if a_scale is not None else dummy, ws, topk_weights,
        sorted_ids, expert_ids, num_post,
        n_out, k_in, num_valid, num_m_blocks,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1),
        ws.stride(0) if w_mode else 0, (ws.stride(1) if w_mode == 2 else 0),
        A_ROW_DIV=a_row_div, GATE_UP=gate_up, EPI=epi, MUL_ROUTED=mul_routed,
        A_MODE=a_mode, W_SCALE=w_mode, EVEN_K=k_in % cfg["BLOCK_K"] == 0,
        SWAP_AB=cfg["SWAP_AB"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], FP8_PREROUND=a_mode >= 2 and _INTERPRET,
        SPLIT_K=split_k, A_SILU=a_silu, C_ROW_DIV=c_row_div,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float -> fp8 [M, K] with the static per-tensor scale (one launch)."""
    M, K = x.shape
    y = torch.empty((M, K), dtype=FP8, device=x.device)
    bk = min(1024, triton.next_power_of_2(K))
    launch(quant_fp8_kernel, (M, triton.cdiv(K, bk)), x, y, scale, K, x.stride(0), y.stride(0),
           FP8_PREROUND=_INTERPRET, BLOCK_K=bk, num_warps=4)
    return y


def num_programs(M: int, E: int, N: int, K: int, topk: int, cfg: dict[str, Any]) -> tuple[int, int]:
    """(GEMM1, GEMM2) programs of a config that do work when every (token, expert) pair is
    a distinct expert (decode worst case for the block count: min(T, E) hit experts)."""
    T = M * topk
    if cfg.get("DECODE"):
        return min(T, E) * -(-N // cfg["BLOCK_N"]), M * -(-K // configs.down_config(cfg)["BLOCK_N"])
    blocks = -(-max_padded_len(T, E, cfg["BLOCK_M"]) // cfg["BLOCK_M"])
    down = configs.down_config(cfg)
    rows1 = N if cfg.get("FUSE_GU", True) else 2 * N
    g1 = blocks * -(-rows1 // cfg["BLOCK_N"]) * int(cfg.get("SPLIT_K", 1))
    g2 = blocks * -(-K // down["BLOCK_N"]) * int(down.get("SPLIT_K", 1))
    return g1, g2


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, fp8: Fp8Scales | None = None,
              apply_router_weight_on_input: bool = False, out: torch.Tensor | None = None,
              config: dict[str, Any] | None = None) -> torch.Tensor:
    """MoE expert computation: out[m] = sum_j w_j * W2[e_j] (silu(W1g[e_j] x_m) * W1u[e_j] x_m).

    hidden_states [M, K] bf16/fp16/fp32 (or fp8 with fp8.a1_scale); w1 [E, 2N, K] (gate rows
    0..N-1, up rows N..2N-1); w2 [E, K, N]; topk_weights [M, topk] float32; topk_ids [M, topk]
    int32/int64. Returns [M, K] in hidden_states' dtype (bf16 for fp8 input). `config`
    overrides the table/heuristic choice (tuner, tests).
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
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    topk_weights = topk_weights.contiguous()

    cfg = config or configs.get_config(M, E, N, K, topk, dtype_name(w1.dtype),
                                       act_bytes=hidden_states.element_size())
    if cfg.get("DECODE"):
        return _fused_moe_decode(hidden_states, w1, w2, topk_weights, topk_ids, fp8,
                                 apply_router_weight_on_input, out, cfg)
    down = configs.down_config(cfg)
    align = moe_align(topk_ids, E, cfg["BLOCK_M"])
    T = M * topk
    dev = hidden_states.device
    w1s, w1_mode, w2s, w2_mode, a1s, a2s = _scales(fp8, E, N, K)
    split1 = int(cfg.get("SPLIT_K", 1))
    split2 = int(down.get("SPLIT_K", 1))
    fused1 = split1 == 1 and cfg.get("FUSE_GU", True)
    a_mode1 = _a_mode(hidden_states.dtype, a1s, use_fp8, "a1_scale")
    x1 = hidden_states
    if cfg.get("A_PREQUANT") and a_mode1 == 2:       # static scale: quantize x once, not per tile
        x1 = _quant_static(hidden_states, a1s)
        a_mode1 = 1
    # one fp32 workspace: [h (T x 2N) when GEMM1 is split/un-fused][c32 (M x K) when GEMM2 split]
    n_h = 0 if fused1 else T * 2 * N
    n_c = M * K if split2 > 1 else 0
    ws = None
    if n_h + n_c:
        ws = torch.empty(n_h + n_c, dtype=torch.float32, device=dev)
        if split1 > 1 or split2 > 1:
            ws.zero_()                                                 # one memset
    if fused1:
        act = torch.empty((T, N), dtype=out_dtype, device=dev)        # [T, N]
        _launch_gemm(x1, w1, act, N, K, a1s, w1s, w1_mode, a_mode1, topk_weights,
                     align, T, topk, True, 1, apply_router_weight_on_input, cfg)
    else:
        act = ws[:n_h].view(T, 2 * N)                                 # h = [gate | up], fp32
        gate_up = bool(cfg.get("FUSE_GU", True))
        _launch_gemm(x1, w1, act, N if gate_up else 2 * N, K, a1s, w1s, w1_mode,
                     a_mode1, topk_weights, align, T, topk, gate_up, 2 if split1 > 1 else 0,
                     apply_router_weight_on_input, cfg)
    a_mode2 = _a_mode(act.dtype, a2s, use_fp8, "a2_scale")
    if split2 > 1:
        c32 = ws[n_h:].view(M, K)
        _launch_gemm(act, w2, c32, K, N, a2s, w2s, w2_mode, a_mode2, topk_weights, align,
                     T, 1, False, 2, not apply_router_weight_on_input, down,
                     a_silu=not fused1, c_row_div=topk)
        bk = min(1024, triton.next_power_of_2(K))
        launch(topk_sum_kernel, (M, triton.cdiv(K, bk)),
               c32, out, K, c32.stride(0), out.stride(0), TOPK=1, BLOCK_K=bk, num_warps=4)
        return out
    c2 = out if topk == 1 else torch.empty((T, K), dtype=out_dtype, device=dev)  # [T, K]
    _launch_gemm(act, w2, c2, K, N, a2s, w2s, w2_mode, a_mode2, topk_weights, align,
                 T, 1, False, 0, not apply_router_weight_on_input, down, a_silu=not fused1)
    if topk > 1:
        bk = min(1024, triton.next_power_of_2(K))
        launch(topk_sum_kernel, (M, triton.cdiv(K, bk)),
               c2, out, K, c2.stride(0), out.stride(0), TOPK=topk, BLOCK_K=bk, num_warps=4)
    return out


def _fused_moe_decode(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tw: torch.Tensor,
                      ids: torch.Tensor, fp8: Fp8Scales | None, on_input: bool, out: torch.Tensor,
                      cfg: dict[str, Any]) -> torch.Tensor:
    """The two-launch small-batch path (kernels.moe.moe_decode); shapes checked by fused_moe."""
    M, K = x.shape
    E, N = w1.shape[0], w1.shape[1] // 2
    topk = ids.shape[1]
    T = M * topk
    if T > cfg["BLOCK_M"]:
        raise ValueError(f"decode config BLOCK_M={cfg['BLOCK_M']} < M*topk={T}")
    ids = ids.contiguous()
    down = configs.down_config(cfg)
    use_fp8 = fp8 is not None
    w1s, w1_mode, w2s, w2_mode, a1s, a2s = _scales(fp8, E, N, K)
    dummy = tw
    pdl = bool(cfg.get("PDL")) and not _INTERPRET
    a_mode1 = _a_mode(x.dtype, a1s, use_fp8, "a1_scale")
    c_fp8 = use_fp8 and a2s is not None           # quantized once, in GEMM1's epilogue
    act = torch.empty((T, N), dtype=FP8 if c_fp8 else out.dtype, device=x.device)  # [T, N]
    a_mode2 = 0 if not use_fp8 else 1 if c_fp8 else 3
    ws1 = w1s if w1s is not None else dummy
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    bn2, bk2 = down["BLOCK_N"], down["BLOCK_K"]
    split1, split2 = int(cfg.get("SPLIT_K", 1)), int(down.get("SPLIT_K", 1))
    h = o = cnt1 = cnt2 = dummy
    if split1 > 1 or split2 > 1:     # one workspace: [h: T x 2N][o: M x K], counters likewise
        n_h = T * 2 * N if split1 > 1 else 0
        n_c1 = T * triton.cdiv(N, bn) if split1 > 1 else 0
        n_o = M * K if split2 > 1 else 0
        n_c2 = M * triton.cdiv(K, bn2) if split2 > 1 else 0
        wsf, wsc = split_workspace(x.device, n_h + n_o, n_c1 + n_c2)
        h, o = wsf[:max(1, n_h)], wsf[n_h:n_h + max(1, n_o)]
        cnt1, cnt2 = wsc[:max(1, n_c1)], wsc[n_c1:n_c1 + max(1, n_c2)]
    launch(
        moe_decode_up_kernel, (T, triton.cdiv(N, bn), split1),
        x, w1, act, ids, tw, a1s if a1s is not None else dummy, ws1,
        a2s if c_fp8 else dummy, h, cnt1,
        N, K, T,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        act.stride(0), act.stride(1),
        ws1.stride(0) if w1_mode else 0, ws1.stride(1) if w1_mode == 2 else 0,
        TOPK=topk, MUL_ROUTED=on_input, A_MODE=a_mode1, W_SCALE=w1_mode, C_FP8=c_fp8,
        EVEN_K=K % bk == 0, SWAP_AB=cfg["SWAP_AB"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
        BLOCK_K=bk, FP8_PREROUND=a_mode1 >= 2 and _INTERPRET, USE_PDL=pdl, SPLIT_K=split1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    ws2 = w2s if w2s is not None else dummy
    launch(
        moe_decode_down_kernel, (M * triton.cdiv(K, bn2), split2),
        act, w2, out, ids, tw, a2s if a2s is not None else dummy, ws2, o, cnt2,
        K, N, M,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1),
        ws2.stride(0) if w2_mode else 0, ws2.stride(1) if w2_mode == 2 else 0,
        TOPK=topk, MUL_ROUTED=not on_input, A_MODE=a_mode2, W_SCALE=w2_mode,
        EVEN_N=N % bk2 == 0, SWAP_AB=down["SWAP_AB"],
        BLOCK_M=max(16, triton.next_power_of_2(topk)), BLOCK_N=bn2, BLOCK_K=bk2,
        FP8_PREROUND=a_mode2 >= 2 and _INTERPRET, USE_PDL=pdl, SPLIT_K=split2,
        num_warps=down["num_warps"], num_stages=down["num_stages"],
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
