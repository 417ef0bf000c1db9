"""Small-batch (decode) MoE kernels: two launches, no alignment pass, no top-k sum pass.

T = M * topk token slots (slot s = m * topk + j routes token m to expert ids[s]). Both
kernels read expert ids straight from topk_ids; BLOCK_M >= T is a compile-time row count.

moe_decode_up_kernel    grid (T, cdiv(N, BLOCK_N))
    Program (s, n) owns expert e = ids[s] if s is e's first slot (else it exits at once), so
    every hit expert's weights are read once. Its A tile holds all T slots' token rows,
    masked to the slots routed to e:
        h[s', n] = sum_k x[s' // topk, k] * w1[e, n, k]          (gate rows n, up rows N + n)
        act[s', n] = silu(gate) * up   in act's dtype (bf16 / fp32), or fp8 quantized once, here,
                                       for GEMM2 (C_QUANT as in moe_serve.kernels.moe.moe_gemm: the static a2
                                       scale, or dynamic per slot and GROUP_K columns)

moe_decode_down_kernel  grid (M * cdiv(K, BLOCK_N),)   (token fastest: tokens that share an
    expert read the same weight tile at the same time, from L2)
    Program (m, k-tile) loops over its topk slots and their N chunks in one flat loop:
        out[m, k] = sum_j rw[m, j] * sum_n w2[e_j, k, n] * act[m * topk + j, n]
    fp32 accumulation in registers, one store of the output dtype: the routed weight and the
    top-k reduction ride in the epilogue.

A_MODE (activations) as in moe_serve.kernels.moe.moe_gemm: 0 float; 1 fp8 input with a static scale;
2 static scale, quantized on load; 3 dynamic per-row scale (absmax / 448, one pre-pass);
4 fp8 input, per-row scale; 5 fp8 input, per-row-and-group scales; 6 dynamic per row and group,
quantized on load (BLOCK_K == GROUP_K). The down kernel takes 0-3, 5 and 6.
W_SCALE: 0 none, 1 per-tensor ([E]), 2 per-channel ([E, rows of w]), 3 block
([E, cdiv(rows, GROUP_N), cdiv(cols, GROUP_K)], applied per K step with A_MODE 5/6).
SWAP_AB: acc[BN, BM] += w[BN, BK] @ a^T[BK, BM], so weight rows fill wgmma's 64-row slot.
USE_PDL (sm_90+): the down kernel is a programmatic dependent launch, released by the up kernel
first thing (gdc_launch_dependents); it waits (gdc_wait) for the up kernel only before its first
act load. It reads expert ids before that wait: they are final, since the up kernel itself
started only after whatever wrote them had finished, either launched plainly or, with PDL_WAIT
(the block chained, moe_serve.kernels.moe.launch.block_pdl), launched early but waiting (gdc_wait) for the
kernel before it before it releases the down kernel.

PREFETCH (sm_90+; 0 off): each up program owning expert e also prefetches its share of e's
down weights (w2[e], contiguous) into L2 by bulk prefetch, so the down kernel reads them from L2:
1 as it starts (the prefetch streams beside its own K loop), 2 after its K loop (in the up
kernel's tail). The results do not change.

SPLIT_K > 1 (either kernel; a shape with few programs per SM, e.g. one token): program_id of
the split axis s reduces its share of the reduction (up: K tiles; down: the flat slot x N-chunk
loop) and adds its fp32 partial into a workspace with atomics; the program that finishes a
tile last (a per-tile arrival counter, acq_rel) reads the sums back while zeroing them
(atomic exchange), resets the counter, and runs the epilogue. Workspace and counters are
therefore zero again after every call (see moe_serve.kernels.moe.moe_decode_launch.split_workspace): no memset
launch, and the path stays two launches under CUDA graphs.
"""
from __future__ import annotations

import triton.language as tl

from moe_serve.kernels.moe.launch import jit
from moe_serve.kernels.moe.moe_tiles import (_a_scale, _arrive_last, _dequant, _group_quant_cols, _mma,
                                   _mma_scaled, _prefetch_l2, _quant_a, _quant_fp8, _split_range,
                                   _take, _take_row, _token_scale)


@jit(do_not_specialize=["num_slots"])
def moe_decode_up_kernel(
    # pointers (h_ptr [>= T, 2N] fp32 and cnt_ptr [>= T * cdiv(N, BLOCK_N)] int32: the split
    # workspace, zero between calls; unused when SPLIT_K == 1; w2_ptr: the down weights, read
    # only by PREFETCH)
    x_ptr, w_ptr, c_ptr, ids_ptr, topk_w_ptr, a_scale_ptr, w_scale_ptr, c_scale_ptr,
    h_ptr, cnt_ptr, w2_ptr,
    # sizes: N = gate (= up) rows of w1, K = hidden, num_slots = T, w2_bytes = bytes of one
    # expert's w2
    N, K, num_slots, w2_bytes,
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    stride_cs, stride_cn, stride_se, stride_sn,
    stride_asm, stride_ask, stride_sk, stride_css, stride_csg,
    # constexprs
    TOPK: tl.constexpr, MUL_ROUTED: tl.constexpr, A_MODE: tl.constexpr,
    W_SCALE: tl.constexpr, C_QUANT: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8_PREROUND: tl.constexpr, USE_PDL: tl.constexpr, PDL_WAIT: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    PREFETCH: tl.constexpr, PF_CHUNK: tl.constexpr, PF_SLOTS: tl.constexpr,
):
    if PDL_WAIT:                       # launched early: wait for the kernel before us (router,
        tl.extra.cuda.gdc_wait()       # top-k or the quantize pass) before reading anything
    if USE_PDL:                        # let the down kernel's programs launch
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM] slots
    ids = tl.load(ids_ptr + offs_m, mask=offs_m < num_slots, other=-1)
    e = tl.load(ids_ptr + s)
    if e < 0:                                                        # not a local expert
        return
    if tl.sum(((ids == e) & (offs_m < s)).to(tl.int32), axis=0) > 0:  # e's first slot only
        return
    rows = ids == e                                                  # [BM] slots of e
    expert = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    x_row = (offs_m // TOPK).to(tl.int64)                            # [BM] token of each slot
    a_ptrs = x_ptr + x_row[:, None] * stride_xm + offs_k[None, :] * stride_xk      # [BM, BK]
    wg_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn \
        + offs_k[None, :] * stride_wk                                                # [BN, BK]
    wu_ptrs = wg_ptrs + N * stride_wn
    as_ptrs = a_scale_ptr + x_row * stride_asm                       # A_MODE 5: [BM] rows
    if W_SCALE == 3:                                                 # [BN] rows' block scales
        sg_ptrs = w_scale_ptr + expert * stride_se + (offs_n // GROUP_N) * stride_sn
        su_ptrs = w_scale_ptr + expert * stride_se + ((offs_n + N) // GROUP_N) * stride_sn

    pf_part = pid_n * SPLIT_K + tl.program_id(2)                     # e's down weights, shared
    pf_parts = tl.num_programs(1) * SPLIT_K                          # by e's programs
    if PREFETCH == 1:
        _prefetch_l2(w2_ptr, expert * w2_bytes, w2_bytes, pf_part, pf_parts, PF_CHUNK, PF_SLOTS)

    k_lo, k_hi = _split_range(tl.cdiv(K, BLOCK_K), tl.program_id(2), SPLIT_K)   # K tiles
    a_scale, a_inv = _a_scale(a_scale_ptr, a_ptrs, x_row, rows, 0, K, stride_xk, stride_asm,
                              BLOCK_K, A_MODE, False)

    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs += k_lo * BLOCK_K * stride_xk
    wg_ptrs += k_lo * BLOCK_K * stride_wk
    wu_ptrs += k_lo * BLOCK_K * stride_wk
    for k in range(k_lo, k_hi):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows[:, None], other=0.0)
            wg = tl.load(wg_ptrs, mask=n_mask[:, None], other=0.0)
            wu = tl.load(wu_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            kmask = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rows[:, None] & kmask, other=0.0)
            wg = tl.load(wg_ptrs, mask=n_mask[:, None] & kmask, other=0.0)
            wu = tl.load(wu_ptrs, mask=n_mask[:, None] & kmask, other=0.0)
        g = k * BLOCK_K // GROUP_K if W_SCALE == 3 else 0            # activation group
        a, a_s = _quant_a(a, wg, a_inv, as_ptrs, g, stride_ask, rows, A_MODE, FP8_PREROUND)
        if W_SCALE == 3:
            acc_g = _mma_scaled(acc_g, a, wg, a_s,
                                tl.load(sg_ptrs + g * stride_sk, mask=n_mask, other=0.0), SWAP_AB)
            acc_u = _mma_scaled(acc_u, a, wu, a_s,
                                tl.load(su_ptrs + g * stride_sk, mask=n_mask, other=0.0), SWAP_AB)
        else:
            acc_g = _mma(acc_g, a, wg, SWAP_AB)
            acc_u = _mma(acc_u, a, wu, SWAP_AB)
        a_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    if PREFETCH == 2:
        _prefetch_l2(w2_ptr, expert * w2_bytes, w2_bytes, pf_part, pf_parts, PF_CHUNK, PF_SLOTS)
    if SWAP_AB:
        acc_g = tl.trans(acc_g)                                      # [BM, BN]
        acc_u = tl.trans(acc_u)
    c_mask = rows[:, None] & n_mask[None, :]
    if SPLIT_K > 1:                  # add the partials; the tile's last program goes on
        h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * (2 * N) + offs_n[None, :]   # [BM, BN]
        tl.atomic_add(h_ptrs, acc_g, mask=c_mask, sem="relaxed", scope="gpu")
        tl.atomic_add(h_ptrs + N, acc_u, mask=c_mask, sem="relaxed", scope="gpu")
        if not _arrive_last(cnt_ptr + s * tl.num_programs(1) + pid_n, SPLIT_K):
            return
        acc_g = _take(h_ptrs, c_mask, BLOCK_M, BLOCK_N)
        acc_u = _take(h_ptrs + N, c_mask, BLOCK_M, BLOCK_N)

    # ---- epilogue: dequant, routed weight (on input), SiLU-and-mul, store --------------------
    acc_g = _dequant(acc_g, a_scale, w_scale_ptr, expert, stride_se, offs_n, N, stride_sn,
                     A_MODE, W_SCALE)
    acc_u = _dequant(acc_u, a_scale, w_scale_ptr, expert, stride_se, offs_n + N, 2 * N,
                     stride_sn, A_MODE, W_SCALE)
    if MUL_ROUTED:
        rw = tl.load(topk_w_ptr + offs_m, mask=rows, other=0.0).to(tl.float32)[:, None]
        acc_g = acc_g * rw
        acc_u = acc_u * rw
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cs + offs_n[None, :] * stride_cn
    res = acc_g * tl.sigmoid(acc_g) * acc_u
    if C_QUANT == 1:
        res = _quant_fp8(res, 1.0 / tl.load(c_scale_ptr).to(tl.float32), FP8_PREROUND)
    elif C_QUANT == 2:                 # BLOCK_N % GROUP_K == 0: this tile holds whole groups
        offs_g = pid_n * (BLOCK_N // GROUP_K) + tl.arange(0, BLOCK_N // GROUP_K)
        s_ptrs = c_scale_ptr + offs_m[:, None].to(tl.int64) * stride_css + offs_g[None, :] * stride_csg
        res = _group_quant_cols(res, n_mask[None, :], s_ptrs,
                                rows[:, None] & (offs_g[None, :] * GROUP_K < N),
                                BLOCK_N // GROUP_K, GROUP_K, FP8_PREROUND)
    tl.store(c_ptrs, res.to(c_ptr.dtype.element_ty), mask=c_mask)


@jit(do_not_specialize=["M"])
def moe_decode_down_kernel(
    # pointers (o_ptr [>= M, K] fp32 and cnt_ptr [>= M * cdiv(K, BLOCK_N)] int32: the split
    # workspace, zero between calls; unused when SPLIT_K == 1)
    a_ptr, w_ptr, out_ptr, ids_ptr, topk_w_ptr, a_scale_ptr, w_scale_ptr, o_ptr, cnt_ptr,
    # sizes: K = output columns (hidden), N = reduction (intermediate), M tokens
    K, N, M,
    # strides
    stride_as, stride_an, stride_we, stride_wk, stride_wn,
    stride_om, stride_ok, stride_se, stride_sk,
    stride_ass, stride_asg, stride_sn,          # act group scales [T, groups]; w2 block scales
    # constexprs
    TOPK: tl.constexpr, MUL_ROUTED: tl.constexpr, A_MODE: tl.constexpr, W_SCALE: tl.constexpr,
    EVEN_N: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8_PREROUND: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
):
    """Grid (M * cdiv(K, BLOCK_N), SPLIT_K). Row j of the [BLOCK_M >= TOPK, BK] A tile
    carries slot j's chunk (other rows zero), so
    acc[j, :] accumulates slot j's product with its own expert; per-row scales (routed
    weight, weight and activation scales) and the sum over rows come once, after the loop;
    block scales (A_MODE 5/6, W_SCALE 3: chunk c is activation group c) scale each chunk's
    product."""
    pid = tl.program_id(0)
    m = (pid % M).to(tl.int64)
    pid_k = pid // M
    offs_j = tl.arange(0, BLOCK_M)                                   # [BM] this token's slots
    j_mask = offs_j < TOPK
    slots = m * TOPK + offs_j
    ids = tl.load(ids_ptr + slots, mask=j_mask, other=-1).to(tl.int64)   # [BM]
    offs_kout = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)              # [BN] output columns
    k_mask = offs_kout < K
    offs_c = tl.arange(0, BLOCK_K)                                   # [BK] reduction chunk
    n_chunks = tl.cdiv(N, BLOCK_K)
    row_ptrs = a_ptr + slots[:, None] * stride_as + offs_c[None, :] * stride_an   # [BM, BK]

    if USE_PDL:                        # launched early (programmatic dependent launch):
        tl.extra.cuda.gdc_wait()       # wait for the up kernel's act before reading it
    if A_MODE == 3:                                                  # per-slot absmax over N
        row_scale = _token_scale(row_ptrs, j_mask, 0, N, stride_an, BLOCK_K, False)  # [BM]
        a_inv = (1.0 / row_scale)[:, None]
    elif A_MODE == 1 or A_MODE == 2:
        a_scale = tl.load(a_scale_ptr).to(tl.float32)
        a_inv = 1.0 / a_scale
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + a_scale
    else:                                                            # none, or per chunk
        a_inv = 1.0
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    it_lo, it_hi = _split_range(TOPK * n_chunks, tl.program_id(1), SPLIT_K)   # slots x chunks
    for it in range(it_lo, it_hi):
        j = it // n_chunks
        c = it - j * n_chunks
        e = tl.sum(tl.where(offs_j == j, ids, 0), axis=0)             # no in-loop load
        w_ptrs = w_ptr + tl.maximum(e, 0) * stride_we + offs_kout[:, None] * stride_wk \
            + (c * BLOCK_K + offs_c)[None, :] * stride_wn                            # [BN, BK]
        a_mask = offs_j[:, None] == tl.where(e >= 0, j, -1)          # row j; none if e < 0
        w_mask = offs_kout[:, None] < tl.where(e >= 0, K, 0)
        if not EVEN_N:
            cm = offs_c[None, :] < N - c * BLOCK_K
            a_mask = a_mask & cm
            w_mask = w_mask & cm
        a = tl.load(row_ptrs + c * BLOCK_K * stride_an, mask=a_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        a, a_s = _quant_a(a, w, a_inv, a_scale_ptr + slots * stride_ass, c, stride_asg, j_mask,
                          A_MODE, FP8_PREROUND)
        if W_SCALE == 3:               # w2 block scales of expert e, output rows, group c
            w_s = tl.load(w_scale_ptr + tl.maximum(e, 0) * stride_se + (offs_kout // GROUP_N) * stride_sk
                          + c * stride_sn, mask=offs_kout < tl.where(e >= 0, K, 0), other=0.0)
            acc = _mma_scaled(acc, a, w, a_s, w_s, SWAP_AB)
        else:
            acc = _mma(acc, a, w, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)                                          # [BM, BN]

    # ---- epilogue: per-slot scales, then the top-k reduction ------------------------------
    valid = j_mask & (ids >= 0)
    e_rows = tl.maximum(ids, 0)
    if W_SCALE == 1:
        row_scale = row_scale * tl.load(w_scale_ptr + e_rows * stride_se, mask=valid, other=0.0)
    if MUL_ROUTED:
        row_scale = row_scale * tl.load(topk_w_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    acc = acc * tl.where(valid, row_scale, 0.0)[:, None]
    if W_SCALE == 2:
        s_ptrs = w_scale_ptr + e_rows[:, None] * stride_se + offs_kout[None, :] * stride_sk
        acc = acc * tl.load(s_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
    out = tl.sum(acc, axis=0)                                        # [BN]
    if SPLIT_K > 1:                  # add the partial row; the tile's last program stores
        o_ptrs = o_ptr + m * K + offs_kout
        tl.atomic_add(o_ptrs, out, mask=k_mask, sem="relaxed", scope="gpu")
        if not _arrive_last(cnt_ptr + pid, SPLIT_K):
            return
        out = _take_row(o_ptrs, k_mask, BLOCK_N)
    tl.store(out_ptr + m * stride_om + offs_kout * stride_ok,
             out.to(out_ptr.dtype.element_ty), mask=k_mask)
