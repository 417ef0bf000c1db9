"""The one grouped-expert GEMM kernel of the fused MoE (both GEMMs, swap-AB, FP8 W8A8).

c[slot, n] = epilogue( sum_k a[slot // A_ROW_DIV, k] * w[expert(slot), n, k] )

GEMM1 (GATE_UP, EPI 1): w = w1 [E, 2N, K]; gate rows n, up rows N + n; writes
    act[slot, n] = silu(g) * u            (g, u dequantized, optionally * routed weight)
GEMM2:             w = w2 [E, K, N]; writes c[slot, k] (optionally * routed weight).

Split-K / un-fused paths (decode: fill the GPU with programs streaming weights):
GATE_UP: one program computes the gate tile (rows n) and the up tile (rows N + n); else the
    weight is treated as a plain [rows, K] matrix (GEMM1 un-fused: N = 2N rows, 2x programs).
EPI: 0 store c[slot // C_ROW_DIV, n] in c's dtype (GATE_UP: gate at n, up at N + n);
     1 SiLU-and-mul epilogue (needs GATE_UP, SPLIT_K == 1);
     2 tl.atomic_add of fp32 partial sums into a zeroed fp32 c (any SPLIT_K; all epilogue
       scales are linear, so each K-split applies them to its partial).
SPLIT_K: program_id(1) = K-split s, which reduces K tiles [s*TPS, (s+1)*TPS).
A_SILU: A is a [T, 2K] pre-activation h (gate cols 0..K-1, up cols K..2K-1, fp32 sums of an
    un-fused/split GEMM1): the A tile is silu(h_gate) * h_up computed on load (GEMM2).

A_MODE (activation handling):
    0: float A, float W (bf16/fp16/fp32 tl.dot)
    1: A already fp8, static per-tensor scale a_scale_ptr[0] applied in the epilogue
    2: float A, static per-tensor scale: quantized to fp8 inside the K loop
    3: float A, dynamic per-token scale (row absmax / 448): one absmax pass over K, then
       quantized to fp8 inside the K loop
W_SCALE: 0 none, 1 per-tensor (one per expert, [E]), 2 per-channel ([E, rows of w]).
SWAP_AB: acc[BN, BM] += w[BN, BK] @ a^T[BK, BM]; one transpose after the K loop, so the
    weight rows fill wgmma's 64-row M slot when BLOCK_M < 64.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.moe.launch import jit

FP8_MAX = 448.0


@triton.jit
def _quant_fp8(a, inv_scale, PREROUND: tl.constexpr):
    """Scale, clamp to +-448 and cast a float tile to float8_e4m3fn.

    PREROUND (interpreter only): Triton's interpreter drops the carry when rounding crosses a
    power of two (124.3 -> 64, not 128), so there we first round the fp32 mantissa to 3 bits
    (nearest-even) with integer ops and the cast becomes exact. The GPU uses cvt.rn directly."""
    q = tl.clamp(a.to(tl.float32) * inv_scale, -448.0, 448.0)
    if PREROUND:
        bits = q.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep sign, exp, 3 mantissa bits
        q = bits.to(tl.float32, bitcast=True)
    return q.to(tl.float8e4nv)


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr):
    """acc[BM, BN] += a[BM, BK] @ w[BN, BK]^T, or swapped acc[BN, BM] += w @ a^T."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _load_a(a_ptrs, mask, up_off, A_SILU: tl.constexpr):
    """A tile; with A_SILU: silu(gate) * up from the two halves of h (fp32)."""
    if A_SILU:
        g = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(a_ptrs + up_off, mask=mask, other=0.0).to(tl.float32)
        return g * tl.sigmoid(g) * u
    else:
        return tl.load(a_ptrs, mask=mask, other=0.0)


@triton.jit
def _token_scale(a_ptrs, row_mask, up_off, n_cols, step, BLOCK_K: tl.constexpr,
                 A_SILU: tl.constexpr):
    """Dynamic per-row fp8 scale: absmax over the row's n_cols columns / 448 ([BM] fp32).
    a_ptrs: [BM, BK] pointers to the first column chunk; step: a column's pointer stride."""
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros([a_ptrs.shape[0]], dtype=tl.float32)
    for k in range(0, tl.cdiv(n_cols, BLOCK_K)):
        kmask = offs_k[None, :] < n_cols - k * BLOCK_K
        a = _load_a(a_ptrs + k * BLOCK_K * step, row_mask[:, None] & kmask, up_off, A_SILU)
        amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
    return tl.maximum(amax, 1e-10) / 448.0


@triton.jit
def _dequant(acc, a_scale, w_scale_ptr, expert, stride_se, cols, col_limit, stride_sn,
             A_MODE: tl.constexpr, W_SCALE: tl.constexpr):
    """acc [BM, BN] times the activation scale (A_MODE 3: per row [BM]; 1, 2: scalar) and the
    weight scale (W_SCALE 1: the expert's; 2: per weight row `cols` [BN], < col_limit)."""
    if A_MODE == 3:
        acc = acc * a_scale[:, None]
    elif A_MODE != 0:
        acc = acc * a_scale
    if W_SCALE == 1:
        acc = acc * tl.load(w_scale_ptr + expert * stride_se).to(tl.float32)
    elif W_SCALE == 2:
        s = tl.load(w_scale_ptr + expert * stride_se + cols * stride_sn, mask=cols < col_limit,
                    other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    return acc


@jit(do_not_specialize=["num_valid", "num_m_blocks"])
def moe_gemm_kernel(
    # pointers
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    # sizes (N = output columns; the weight has 2N rows when GATE_UP)
    N, K, num_valid, num_m_blocks,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn, stride_se, stride_sn,
    # constexprs
    A_ROW_DIV: tl.constexpr, GATE_UP: tl.constexpr, EPI: tl.constexpr, MUL_ROUTED: tl.constexpr,
    A_MODE: tl.constexpr, W_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FP8_PREROUND: tl.constexpr,
    SPLIT_K: tl.constexpr, A_SILU: tl.constexpr, C_ROW_DIV: tl.constexpr,
):
    # ---- program -> (m block, n tile), grouped for L2 reuse --------------------------
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_in_group = GROUP_M * num_pid_n
    first_m = (pid // pids_in_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_in_group) % group_size
    pid_n = (pid % pids_in_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)            # [BM] token slots
    row_mask = slot < num_valid
    a_row = slot // A_ROW_DIV
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = offs_n % N                                             # wrapped: loads in bounds
    offs_k = tl.arange(0, BLOCK_K)

    up_off = K * stride_ak                                           # A_SILU: up half of h
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak       # [BM, BK]
    wg_ptrs = w_ptr + expert * stride_we + offs_nw[:, None] * stride_wn \
        + offs_k[None, :] * stride_wk                                                # [BN, BK]
    wu_ptrs = wg_ptrs + N * stride_wn

    # ---- activation scale ------------------------------------------------------------
    a_scale = 1.0
    if A_MODE == 3:
        a_scale = _token_scale(a_ptrs, row_mask, up_off, K, stride_ak, BLOCK_K, A_SILU)  # [BM]
        a_inv = (1.0 / a_scale)[:, None]
    elif A_MODE != 0:
        a_scale = tl.load(a_scale_ptr).to(tl.float32)                # scalar
        a_inv = 1.0 / a_scale

    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # ---- main loop over this program's K tiles ---------------------------------------
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_K > 1:
        tiles_per_split = tl.cdiv(num_k_tiles, SPLIT_K)
        k_first = tl.program_id(1) * tiles_per_split
        k_last = tl.minimum(k_first + tiles_per_split, num_k_tiles)
        a_ptrs += k_first * BLOCK_K * stride_ak
        wg_ptrs += k_first * BLOCK_K * stride_wk
        wu_ptrs += k_first * BLOCK_K * stride_wk
    else:
        k_first = 0
        k_last = num_k_tiles
    for k in range(k_first, k_last):
        if EVEN_K:
            a = _load_a(a_ptrs, row_mask[:, None], up_off, A_SILU)
            wg = tl.load(wg_ptrs)
        else:
            kmask = offs_k[None, :] < K - k * BLOCK_K
            a = _load_a(a_ptrs, row_mask[:, None] & kmask, up_off, A_SILU)
            wg = tl.load(wg_ptrs, mask=kmask, other=0.0)
        if A_MODE >= 2:
            a = _quant_fp8(a, a_inv, FP8_PREROUND)
        elif A_MODE == 0:
            a = a.to(wg.dtype)
        acc_g = _mma(acc_g, a, wg, SWAP_AB)
        if GATE_UP:
            if EVEN_K:
                wu = tl.load(wu_ptrs)
            else:
                wu = tl.load(wu_ptrs, mask=kmask, other=0.0)
            acc_u = _mma(acc_u, a, wu, SWAP_AB)
        a_ptrs += BLOCK_K * stride_ak
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk

    if SWAP_AB:
        acc_g = tl.trans(acc_g)                                      # [BM, BN]
        if GATE_UP:
            acc_u = tl.trans(acc_u)

    # ---- epilogue: dequant, routed weight, SiLU-and-mul, store --------------------------
    acc_g = _dequant(acc_g, a_scale, w_scale_ptr, expert, stride_se, offs_nw, N, stride_sn,
                     A_MODE, W_SCALE)
    if GATE_UP:
        acc_u = _dequant(acc_u, a_scale, w_scale_ptr, expert, stride_se, offs_nw + N, 2 * N,
                         stride_sn, A_MODE, W_SCALE)
    if MUL_ROUTED:
        rw = tl.load(topk_w_ptr + slot, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        acc_g = acc_g * rw
        if GATE_UP:
            acc_u = acc_u * rw
    c_mask = row_mask[:, None] & (offs_n[None, :] < N)
    c_ptrs = c_ptr + (slot // C_ROW_DIV)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if EPI == 1:
        res = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(c_ptrs, res.to(c_ptr.dtype.element_ty), mask=c_mask)
    elif EPI == 2:
        tl.atomic_add(c_ptrs, acc_g, mask=c_mask, sem="relaxed")
        if GATE_UP:
            tl.atomic_add(c_ptrs + N * stride_cn, acc_u, mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, acc_g.to(c_ptr.dtype.element_ty), mask=c_mask)
        if GATE_UP:
            tl.store(c_ptrs + N * stride_cn, acc_u.to(c_ptr.dtype.element_ty), mask=c_mask)


@jit()
def quant_fp8_kernel(
    # pointers
    x_ptr, y_ptr, scale_ptr,
    # sizes, strides
    K, stride_xm, stride_ym,
    # constexprs
    FP8_PREROUND: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, k] = fp8(x[m, k] / scale), the static per-tensor scale scale_ptr[0]: GEMM1's input
    quantized once (A_PREQUANT) with the rounding of A_MODE 2. Grid (M, cdiv(K, BLOCK_K))."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0.0)
    inv = 1.0 / tl.load(scale_ptr).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, _quant_fp8(x, inv, FP8_PREROUND), mask=mask)


@jit()
def topk_sum_kernel(
    # pointers
    c_ptr, out_ptr,
    # sizes, strides
    K, stride_cm, stride_om,
    # constexprs
    TOPK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, k] = sum_j c[m * TOPK + j, k]   (fp32 accumulation; grid = (M, cdiv(K, BK)))."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(c_ptr + (m * TOPK + j) * stride_cm + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
