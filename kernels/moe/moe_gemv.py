"""Small-batch (decode) MoE kernels on CUDA cores: the decode path's two launches as matrix-vector
products, one token slot per program, no tensor cores, no shared-memory pipeline.

At one to a few tokens an expert GEMM is a GEMV: every weight element is used once per slot, so
the work is streaming the weights. The tensor-core decode kernels (moe_serve.kernels.moe.moe_decode) need
[64, BK] wgmma tiles in a multi-stage shared-memory pipeline (150-190 KB per program, one program
per SM); these keep a [BLOCK_N, BLOCK_K] weight tile in registers and reduce it against the
token's activations with tl.sum, so small programs run several per SM and keep more bytes in
flight. T = M * topk slots; slot s = m * topk + j routes token m to expert ids[s].

moe_gemv_up_kernel    grid (T, cdiv(N, BLOCK_N), SPLIT_K)     slot fastest: slots that share an
    expert read the same weight tile at the same time, from L2
    act[s, n] = silu(sum_k w1[e, n, k] x[m, k]) * sum_k w1[e, N + n, k] x[m, k]    (e = ids[s])
moe_gemv_down_kernel  grid (M * cdiv(K, BLOCK_N), SPLIT_K)    token fastest
    out[m, k] = sum_j rw[m, j] * sum_n w2[e_j, k, n] act[m * topk + j, n]
    the routed weight and the top-k reduction in registers; one store of the output dtype.

Weights: 16/32-bit floats, or fp8 with W_SCALE 1 (per tensor [E]), 2 (per channel [E, rows]) or
3 (per [GROUP_N, GROUP_K] block), dequantized in fp32: FP8 weights with activations kept in
their float dtype (W8A16), so the activations are never quantized (an FP8 checkpoint's static
activation scales are not needed and not applied; the result is the dequantized weights' exact
product). Hidden states that arrive in fp8 are dequantized on load: A_MODE 1 a static scalar
scale, 4 per token, 5 per token and GROUP_K columns (moe_serve.kernels.moe.moe_gemm's modes).
Block scales (W_SCALE 3) and per-group activation scales (A_MODE 5) apply per GROUP_K columns:
each BLOCK_K step then reduces BLOCK_K // GROUP_K sub-tiles, each scaled by its group's scale.

SPLIT_K > 1 splits each program's reduction (up: K tiles; down: its flat slot x N-chunk loop) and
reduces the fp32 partials in a workspace that is zero again after every call, as in
moe_serve.kernels.moe.moe_decode (the tile's last arrival reads and clears it). USE_PDL / PDL_WAIT as there:
the down kernel is a programmatic dependent launch waiting for the up kernel before its first act
load; with PDL_WAIT the up kernel also waits for the kernel before it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moe_serve.kernels.moe.launch import jit
from moe_serve.kernels.moe.moe_tiles import _arrive_last, _split_range, _take_row


@triton.jit
def _x_chunk(x_ptrs, mask, a_scale_ptr, g, live, stride_ask, A_MODE: tl.constexpr):
    """A chunk of one token's hidden states [SUB_K] as fp32; A_MODE 5 applies its group g's scale
    (past the last group, live false, the chunk is zero and group 0's scale is read instead).
    The per-token and static scales (A_MODE 4, 1) are applied once, in the epilogue."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if A_MODE == 5:
        x = x * tl.load(a_scale_ptr + tl.where(live, g, 0) * stride_ask).to(tl.float32)
    return x


@jit()
def moe_gemv_up_kernel(
    # pointers (h_ptr [>= T, 2N] fp32 and cnt_ptr [>= T * cdiv(N, BLOCK_N)] int32: the split
    # workspace, zero between calls; unused when SPLIT_K == 1)
    x_ptr, w_ptr, c_ptr, ids_ptr, topk_w_ptr, a_scale_ptr, w_scale_ptr, h_ptr, cnt_ptr,
    # sizes: N = gate (= up) rows of w1, K = hidden (the T slots are the grid's first axis)
    N, K,
    # strides (a_scale: [M] or [M, groups]; w_scale: expert, row (block), K group)
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_cs, stride_cn,
    stride_asm, stride_ask, stride_se, stride_sn, stride_sk,
    # constexprs
    TOPK: tl.constexpr, MUL_ROUTED: tl.constexpr, A_MODE: tl.constexpr, W_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    USE_PDL: tl.constexpr, PDL_WAIT: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    if PDL_WAIT:                       # launched early: wait for the kernel before us
        tl.extra.cuda.gdc_wait()
    if USE_PDL:                        # let the down kernel's programs launch
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + s)
    if e < 0:                                                        # not a local expert
        return
    expert = e.to(tl.int64)
    m = (s // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] gate rows
    n_mask = offs_n < N
    offs_k = tl.arange(0, SUB_K)
    x_ptrs = x_ptr + m * stride_xm + offs_k * stride_xk              # [SUB_K]
    wg_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn \
        + offs_k[None, :] * stride_wk                                # [BN, SUB_K]
    wu_ptrs = wg_ptrs + N * stride_wn
    as_ptr = a_scale_ptr + m * stride_asm
    if W_SCALE == 3:                                                 # [BN] rows' block scales
        sg_ptrs = w_scale_ptr + expert * stride_se + (offs_n // GROUP_N) * stride_sn
        su_ptrs = w_scale_ptr + expert * stride_se + ((offs_n + N) // GROUP_N) * stride_sn

    k_lo, k_hi = _split_range(tl.cdiv(K, BLOCK_K), tl.program_id(2), SPLIT_K)   # K tiles
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kt in range(k_lo, k_hi):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            k0 = kt * BLOCK_K + sub * SUB_K
            if EVEN_K:
                xm = offs_k < SUB_K
                wm = n_mask[:, None]
            else:
                xm = offs_k < K - k0
                wm = n_mask[:, None] & xm[None, :]
            x = _x_chunk(x_ptrs + k0 * stride_xk, xm, as_ptr, k0 // SUB_K, k0 < K, stride_ask,
                         A_MODE)
            wg = tl.load(wg_ptrs + k0 * stride_wk, mask=wm, other=0.0).to(tl.float32)
            wu = tl.load(wu_ptrs + k0 * stride_wk, mask=wm, other=0.0).to(tl.float32)
            pg = tl.sum(wg * x[None, :], axis=1)                     # [BN]
            pu = tl.sum(wu * x[None, :], axis=1)
            if W_SCALE == 3:                                         # group k0 // SUB_K
                sm = offs_n < tl.where(k0 < K, N, 0)                  # no group past K
                pg = pg * tl.load(sg_ptrs + (k0 // SUB_K) * stride_sk, mask=sm, other=0.0)
                pu = pu * tl.load(su_ptrs + (k0 // SUB_K) * stride_sk, mask=sm, other=0.0)
            acc_g += pg
            acc_u += pu
    if SPLIT_K > 1:                  # add the partials; the tile's last program goes on
        h_ptrs = h_ptr + s.to(tl.int64) * (2 * N) + offs_n                # [BN]
        tl.atomic_add(h_ptrs, acc_g, mask=n_mask, sem="relaxed", scope="gpu")
        tl.atomic_add(h_ptrs + N, acc_u, mask=n_mask, sem="relaxed", scope="gpu")
        if not _arrive_last(cnt_ptr + s * tl.num_programs(1) + pid_n, SPLIT_K):
            return
        acc_g = _take_row(h_ptrs, n_mask, BLOCK_N)
        acc_u = _take_row(h_ptrs + N, n_mask, BLOCK_N)

    # ---- epilogue: per-tensor / per-row scales, routed weight (on input), SiLU-and-mul ------
    if A_MODE == 1:
        acc_g = acc_g * tl.load(a_scale_ptr).to(tl.float32)
        acc_u = acc_u * tl.load(a_scale_ptr).to(tl.float32)
    elif A_MODE == 4:
        acc_g = acc_g * tl.load(as_ptr).to(tl.float32)
        acc_u = acc_u * tl.load(as_ptr).to(tl.float32)
    if W_SCALE == 1:
        acc_g = acc_g * tl.load(w_scale_ptr + expert * stride_se).to(tl.float32)
        acc_u = acc_u * tl.load(w_scale_ptr + expert * stride_se).to(tl.float32)
    elif W_SCALE == 2:
        acc_g = acc_g * tl.load(w_scale_ptr + expert * stride_se + offs_n * stride_sn,
                                mask=n_mask, other=0.0).to(tl.float32)
        acc_u = acc_u * tl.load(w_scale_ptr + expert * stride_se + (offs_n + N) * stride_sn,
                                mask=n_mask, other=0.0).to(tl.float32)
    if MUL_ROUTED:
        rw = tl.load(topk_w_ptr + s).to(tl.float32)
        acc_g = acc_g * rw
        acc_u = acc_u * rw
    res = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(c_ptr + s.to(tl.int64) * stride_cs + offs_n * stride_cn,
             res.to(c_ptr.dtype.element_ty), mask=n_mask)


@jit(do_not_specialize=["M"])
def moe_gemv_down_kernel(
    # pointers (o_ptr [>= M, K] fp32 and cnt_ptr [>= M * cdiv(K, BLOCK_N)] int32: the split
    # workspace, zero between calls; unused when SPLIT_K == 1)
    a_ptr, w_ptr, out_ptr, ids_ptr, topk_w_ptr, w_scale_ptr, o_ptr, cnt_ptr,
    # sizes: K = output columns (hidden), N = reduction (intermediate), M tokens
    K, N, M,
    # strides (w_scale: expert, output row (block), N group)
    stride_as, stride_an, stride_we, stride_wk, stride_wn, stride_om, stride_ok,
    stride_se, stride_sk, stride_sn,
    # constexprs
    TOPK: tl.constexpr, MUL_ROUTED: tl.constexpr, W_SCALE: tl.constexpr, EVEN_N: tl.constexpr,
    TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    """Program (m, output rows) walks its slots j and their BLOCK_K chunks c of act in one
    flat loop (split over SPLIT_K programs); every product is scaled by its slot's routed
    weight and weight scale before it joins the [BLOCK_N] fp32 row sums."""
    pid = tl.program_id(0)
    m = (pid % M).to(tl.int64)
    pid_k = pid // M
    offs_j = tl.arange(0, TOPK_P2)                                   # [TOPK_P2] this token's slots
    j_mask = offs_j < TOPK
    ids = tl.load(ids_ptr + m * TOPK + offs_j, mask=j_mask, other=-1).to(tl.int64)
    rws = tl.load(topk_w_ptr + m * TOPK + offs_j, mask=j_mask, other=0.0).to(tl.float32)
    offs_kout = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)              # [BN] output rows
    k_mask = offs_kout < K
    offs_c = tl.arange(0, SUB_K)
    n_chunks = tl.cdiv(N, BLOCK_K)
    it_lo, it_hi = _split_range(TOPK * n_chunks, tl.program_id(1), SPLIT_K)   # slots x chunks
    if USE_PDL:                        # launched early (programmatic dependent launch):
        tl.extra.cuda.gdc_wait()       # wait for the up kernel's act before reading it
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for it in range(it_lo, it_hi):
        j = it // n_chunks
        c = it - j * n_chunks
        e = tl.sum(tl.where(offs_j == j, ids, 0), axis=0)             # no in-loop load
        valid = e >= 0
        width = tl.where(valid, SUB_K, 0)      # act columns to read (none for e < 0)
        factor = 1.0
        if MUL_ROUTED:
            factor = tl.sum(tl.where(offs_j == j, rws, 0.0), axis=0)
        ee = tl.maximum(e, 0)
        if W_SCALE == 1:
            factor = factor * tl.load(w_scale_ptr + ee * stride_se).to(tl.float32)
        row_ok = offs_kout < tl.where(valid, K, 0)
        a_row = a_ptr + (m * TOPK + j) * stride_as
        w_rows = w_ptr + ee * stride_we + offs_kout[:, None] * stride_wk        # [BN, 1]
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for sub in tl.static_range(BLOCK_K // SUB_K):
            n0 = c * BLOCK_K + sub * SUB_K
            if EVEN_N:
                am = offs_c < width
                wm = row_ok[:, None]
            else:
                am = offs_c < tl.minimum(width, N - n0)
                wm = row_ok[:, None] & am[None, :]
            a = tl.load(a_row + (n0 + offs_c) * stride_an, mask=am, other=0.0).to(tl.float32)
            w = tl.load(w_rows + (n0 + offs_c)[None, :] * stride_wn, mask=wm, other=0.0)
            p = tl.sum(w.to(tl.float32) * a[None, :], axis=1)        # [BN]
            if W_SCALE == 3:           # w2 block scales of expert e: output rows, group n0
                sm = offs_kout < tl.where(valid & (n0 < N), K, 0)     # no group past N
                p = p * tl.load(w_scale_ptr + ee * stride_se + (offs_kout // GROUP_N) * stride_sk
                                + (n0 // SUB_K) * stride_sn, mask=sm, other=0.0)
            part += p
        if W_SCALE == 2:
            part = part * tl.load(w_scale_ptr + ee * stride_se + offs_kout * stride_sk,
                                  mask=row_ok, other=0.0).to(tl.float32)
        acc += part * factor
    if SPLIT_K > 1:                  # add the partial row; the tile's last program stores
        o_ptrs = o_ptr + m * K + offs_kout
        tl.atomic_add(o_ptrs, acc, mask=k_mask, sem="relaxed", scope="gpu")
        if not _arrive_last(cnt_ptr + pid, SPLIT_K):
            return
        acc = _take_row(o_ptrs, k_mask, BLOCK_N)
    tl.store(out_ptr + m * stride_om + offs_kout * stride_ok,
             acc.to(out_ptr.dtype.element_ty), mask=k_mask)
