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

A_MODE (activation handling; a_row = slot // A_ROW_DIV):
    0: float A, float W (bf16/fp16/fp32 tl.dot)
    1: A already fp8, static per-tensor scale a_scale_ptr[0] applied in the epilogue
    2: float A, static per-tensor scale: quantized to fp8 inside the K loop
    3: float A, dynamic per-token scale (row absmax / 448): one absmax pass over K, then
       quantized to fp8 inside the K loop
    4: A already fp8, per-token scale a_scale[a_row] (quantized once, by vLLM or a prologue)
    5: A already fp8, per-token-group scales a_scale[a_row, k // GROUP_K], applied per K step
    6: float A, dynamic per-token-group quantization on load: BLOCK_K == GROUP_K, so each A
       tile row is one group (absmax / 448); its scale is applied per K step
W_SCALE: 0 none, 1 per-tensor (one per expert, [E]), 2 per-channel ([E, rows of w]),
    3 block ([E, cdiv(rows, GROUP_N), cdiv(K, GROUP_K)]), applied per K step with A_MODE 5/6:
    acc += (a @ w^T) * a_scale[row, group] * w_scale[e, row_block, group]   (vLLM's block kernel)
C_QUANT (EPI 1): 0 store c in its dtype; 1 fp8 with the static scale c_scale_ptr[0]; 2 fp8 with
    a dynamic scale per row and GROUP_K columns (BLOCK_N % GROUP_K == 0), written to
    c_scale[row, n // GROUP_K]: GEMM2's A quantized once, in GEMM1's epilogue.
SWAP_AB: acc[BN, BM] += w[BN, BK] @ a^T[BK, BM]; one transpose after the K loop, so the
    weight rows fill wgmma's 64-row M slot when BLOCK_M < 64.
"""
from __future__ import annotations

import triton.language as tl

from moe_serve.kernels.moe.launch import jit
from moe_serve.kernels.moe.moe_tiles import (_a_scale, _dequant, _group_quant, _group_quant_cols, _load_a,
                               _mma, _mma_scaled, _quant_a, _quant_fp8, _token_scale)


@jit(do_not_specialize=["num_valid", "num_m_blocks"])
def moe_gemm_kernel(
    # pointers
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr, c_scale_ptr,
    # sizes (N = output columns; the weight has 2N rows when GATE_UP)
    N, K, num_valid, num_m_blocks,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn, stride_se, stride_sn,
    stride_asm, stride_ask, stride_sk, stride_csm, stride_csk,
    # constexprs
    A_ROW_DIV: tl.constexpr, GATE_UP: tl.constexpr, EPI: tl.constexpr, MUL_ROUTED: tl.constexpr,
    A_MODE: tl.constexpr, W_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FP8_PREROUND: tl.constexpr,
    SPLIT_K: tl.constexpr, A_SILU: tl.constexpr, C_ROW_DIV: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, C_QUANT: tl.constexpr,
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
    as_ptrs = a_scale_ptr + a_row * stride_asm                       # A_MODE 5: [BM] rows
    if W_SCALE == 3:                                                 # [BN] rows' block scales
        sg_ptrs = w_scale_ptr + expert * stride_se + (offs_nw // GROUP_N) * stride_sn
        su_ptrs = w_scale_ptr + expert * stride_se + ((offs_nw + N) // GROUP_N) * stride_sn

    a_scale, a_inv = _a_scale(a_scale_ptr, a_ptrs, a_row, row_mask, up_off, K, stride_ak,
                              stride_asm, BLOCK_K, A_MODE, A_SILU)

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
        g = k * BLOCK_K // GROUP_K if W_SCALE == 3 else 0            # activation group
        a, a_s = _quant_a(a, wg, a_inv, as_ptrs, g, stride_ask, row_mask, A_MODE, FP8_PREROUND)
        if W_SCALE == 3:
            acc_g = _mma_scaled(acc_g, a, wg, a_s, tl.load(sg_ptrs + g * stride_sk), SWAP_AB)
        else:
            acc_g = _mma(acc_g, a, wg, SWAP_AB)
        if GATE_UP:
            if EVEN_K:
                wu = tl.load(wu_ptrs)
            else:
                wu = tl.load(wu_ptrs, mask=kmask, other=0.0)
            if W_SCALE == 3:
                acc_u = _mma_scaled(acc_u, a, wu, a_s, tl.load(su_ptrs + g * stride_sk), SWAP_AB)
            else:
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
    c_row = slot // C_ROW_DIV
    c_ptrs = c_ptr + c_row[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if EPI == 1:
        res = acc_g * tl.sigmoid(acc_g) * acc_u
        if C_QUANT == 1:
            res = _quant_fp8(res, 1.0 / tl.load(c_scale_ptr).to(tl.float32), FP8_PREROUND)
        elif C_QUANT == 2:
            offs_g = pid_n * (BLOCK_N // GROUP_K) + tl.arange(0, BLOCK_N // GROUP_K)
            s_ptrs = c_scale_ptr + c_row[:, None] * stride_csm + offs_g[None, :] * stride_csk
            res = _group_quant_cols(res, offs_n[None, :] < N, s_ptrs,
                                    row_mask[:, None] & (offs_g[None, :] * GROUP_K < N),
                                    BLOCK_N // GROUP_K, GROUP_K, FP8_PREROUND)
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
    K, stride_xm, stride_ym, stride_sm, stride_sk,
    # constexprs
    SCALE: tl.constexpr, FP8_PREROUND: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, k] = fp8(x[m, k] / scale): an A operand quantized once, with the rounding of the
    K loop's on-load quantization (A_MODE 2, 3, 6). m = program_id(0).
    SCALE 0: static per-tensor scale_ptr[0]; grid (M, cdiv(K, BLOCK_K)).
    SCALE 1: dynamic per token, scale[m] = max|x[m, :]| / 448 written at scale_ptr + m * stride_sm;
             grid (M, 1) (an absmax pass, then the quantizing pass).
    SCALE 2: dynamic per token and group of BLOCK_K columns, scale[m, g] written at
             scale_ptr + m * stride_sm + g * stride_sk; grid (M, cdiv(K, BLOCK_K))."""
    m = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + m * stride_xm
    y_row = y_ptr + m * stride_ym
    if SCALE == 1:
        offs = tl.arange(0, BLOCK_K)
        s = _token_scale(x_row + offs[None, :], tl.full([1], 1, tl.int1), 0, K, 1, BLOCK_K,
                         False)                                                   # [1]
        tl.store(scale_ptr + m * stride_sm + tl.arange(0, 1), s)
        inv = (1.0 / s)[:, None]
        for k0 in range(0, K, BLOCK_K):
            mask = (k0 + offs) < K
            x = tl.load(x_row + k0 + offs[None, :], mask=mask[None, :], other=0.0)
            tl.store(y_row + k0 + offs[None, :], _quant_fp8(x, inv, FP8_PREROUND), mask=mask[None, :])
    else:
        g = tl.program_id(1)
        offs = g * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs[None, :], mask=mask[None, :], other=0.0)        # [1, BK]
        if SCALE == 2:
            q, s = _group_quant(x, FP8_PREROUND)
            tl.store(scale_ptr + m * stride_sm + g * stride_sk + tl.arange(0, 1), s)
        else:
            q = _quant_fp8(x, 1.0 / tl.load(scale_ptr).to(tl.float32), FP8_PREROUND)
        tl.store(y_row + offs[None, :], q, mask=mask[None, :])


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
