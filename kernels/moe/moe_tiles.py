"""Tile-level Triton helpers the MoE kernel families share (moe_serve.kernels.moe.moe_gemm, moe_serve.kernels.moe.moe_decode,
moe_serve.kernels.moe.moe_gemv): the MMA step (plain, swapped, block-scaled), the A tile load (optionally
SiLU-and-mul of an fp32 pre-activation), FP8 quantization (static, per token, per token group),
the dequantizing epilogue, the in-kernel split-K reduction (arrival counter, self-clearing
workspace), and an L2 prefetch of a byte range (sm_90 bulk prefetch). A_MODE / W_SCALE are moe_serve.kernels.moe.moe_gemm's."""
from __future__ import annotations

import triton
import triton.language as tl


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
def _mma_scaled(acc, a, w, a_s, w_s, SWAP_AB: tl.constexpr):
    """One block-scaled K step: acc += (a @ w^T) * a_s[:, None] * w_s[None, :] (a_s [BM] the
    rows' group scales, w_s [BN] the weight rows' block scales), or its transpose."""
    if SWAP_AB:
        acc += tl.dot(w, tl.trans(a)) * w_s[:, None] * a_s[None, :]
    else:
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
    return acc


@triton.jit
def _group_quant(a, PREROUND: tl.constexpr):
    """Dynamic fp8 quantization of a [BM, BK] tile whose rows are one activation group each:
    (fp8 tile, scales [BM] = max(|row|, 1e-10) / 448), vLLM's per_token_group_quant_fp8."""
    s = tl.maximum(tl.max(tl.abs(a.to(tl.float32)), axis=1), 1e-10) / 448.0
    return _quant_fp8(a, (1.0 / s)[:, None], PREROUND), s


@triton.jit
def _group_quant_cols(res, col_ok, s_ptrs, s_mask, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                      PREROUND: tl.constexpr):
    """res [BM, GROUPS * GROUP] fp32 -> fp8 with one dynamic scale per row and GROUP columns
    (columns not col_ok count as 0); the scales [BM, GROUPS] are stored at s_ptrs."""
    r = tl.reshape(tl.where(col_ok, res, 0.0), (res.shape[0], GROUPS, GROUP))
    s = tl.maximum(tl.max(tl.abs(r), axis=2), 1e-10) / 448.0                   # [BM, GROUPS]
    tl.store(s_ptrs, s, mask=s_mask)
    return tl.reshape(_quant_fp8(r, (1.0 / s)[:, :, None], PREROUND), (res.shape[0], GROUPS * GROUP))


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
    """acc [BM, BN] times the activation scale (A_MODE 3, 4: per row [BM]; 1, 2: scalar) and the
    weight scale (W_SCALE 1: the expert's; 2: per weight row `cols` [BN], < col_limit). Block
    scales (A_MODE 5, 6; W_SCALE 3) were applied in the K loop."""
    if A_MODE == 3 or A_MODE == 4:
        acc = acc * a_scale[:, None]
    elif A_MODE == 1 or A_MODE == 2:
        acc = acc * a_scale
    if W_SCALE == 1:
        acc = acc * tl.load(w_scale_ptr + expert * stride_se).to(tl.float32)
    elif W_SCALE == 2:
        s = tl.load(w_scale_ptr + expert * stride_se + cols * stride_sn, mask=cols < col_limit,
                    other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    return acc


@triton.jit
def _a_scale(a_scale_ptr, a_ptrs, a_row, row_mask, up_off, n_cols, step, stride_asm,
             BLOCK_K: tl.constexpr, A_MODE: tl.constexpr, A_SILU: tl.constexpr):
    """(scale, 1 / scale) of A before the K loop: per row [BM] (A_MODE 3: absmax pass over
    n_cols; 4: loaded), scalar (1, 2: static), else 1.0 (none, or per group in the loop)."""
    a_scale = 1.0
    if A_MODE == 3:
        a_scale = _token_scale(a_ptrs, row_mask, up_off, n_cols, step, BLOCK_K, A_SILU)
    elif A_MODE == 4:
        a_scale = tl.load(a_scale_ptr + a_row * stride_asm, mask=row_mask, other=1.0).to(tl.float32)
    elif A_MODE == 1 or A_MODE == 2:
        a_scale = tl.load(a_scale_ptr).to(tl.float32)
    if A_MODE == 3:
        a_inv = (1.0 / a_scale)[:, None]
    else:
        a_inv = 1.0 / a_scale
    return a_scale, a_inv


@triton.jit
def _quant_a(a, w, a_inv, as_ptrs, g, stride_ask, row_mask, A_MODE: tl.constexpr,
             PREROUND: tl.constexpr):
    """One K step's A tile as the MMA with the weight tile w takes it, and its group scales
    [BM] (A_MODE 5, 6; else 1.0): quantized on load (2, 3: scale known; 6: per group), or cast
    to w's dtype (0)."""
    a_s = 1.0
    if A_MODE == 2 or A_MODE == 3:
        a = _quant_fp8(a, a_inv, PREROUND)
    elif A_MODE == 6:
        a, a_s = _group_quant(a, PREROUND)
    elif A_MODE == 5:
        a_s = tl.load(as_ptrs + g * stride_ask, mask=row_mask, other=0.0)
    elif A_MODE == 0:
        a = a.to(w.dtype)
    return a, a_s


@triton.jit
def _arrive_last(cnt_ptr, arrivals):
    """Count this program's arrival at its tile (after its partial sums were added); True for
    the last of the `arrivals` programs, which also resets the counter for the next call."""
    tl.debug_barrier()                      # every thread's partial atomics precede the count
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    return last


@triton.jit
def _take(ptrs, mask, R: tl.constexpr, C: tl.constexpr):
    """The reduced [R, C] fp32 sums (read at L2 through an atomic add of zero, so no stale
    cached copy), then zeroed for the next call."""
    zero = tl.zeros((R, C), dtype=tl.float32)
    acc = tl.atomic_add(ptrs, zero, mask=mask, sem="relaxed", scope="gpu")
    tl.store(ptrs, zero, mask=mask)
    return acc


@triton.jit
def _take_row(ptrs, mask, C: tl.constexpr):
    """_take of one [C] row of sums (ptrs, mask: [C])."""
    return tl.sum(_take(ptrs[None, :], mask[None, :], 1, C), axis=0)


@triton.jit
def _split_range(n, split_id, SPLIT_K: tl.constexpr):
    """[lo, hi) of a reduction loop of n steps that split `split_id` of SPLIT_K owns (all of it
    when SPLIT_K == 1); a split past the end gets an empty range."""
    lo = 0
    hi = n
    if SPLIT_K > 1:
        per_split = tl.cdiv(n, SPLIT_K)
        lo = split_id * per_split
        hi = tl.minimum(lo + per_split, n)
    return lo, hi


@triton.jit
def _prefetch_l2(ptr, offset, n_bytes, part, parts, CHUNK: tl.constexpr, SLOTS: tl.constexpr):
    """Prefetch share `part` of `parts` of the n_bytes (a multiple of 16) at byte `offset` from
    ptr (16-byte aligned) into L2: one bulk prefetch (cp.async.bulk.prefetch.L2, sm_90) per
    CHUNK bytes, SLOTS of them per step (one per thread). A hint: nothing waits on it."""
    byte_ptr = ptr.to(tl.pointer_type(tl.uint8)) + offset
    units = n_bytes // 16                                            # 16-byte units
    lo = ((part.to(tl.int64) * units) // parts).to(tl.int32)
    hi = (((part + 1).to(tl.int64) * units) // parts).to(tl.int32)
    offs = tl.arange(0, SLOTS) * (CHUNK // 16)                       # [SLOTS] chunk starts
    for base in range(lo, hi, SLOTS * (CHUNK // 16)):
        start = base + offs
        size = tl.minimum(hi - start, CHUNK // 16) * 16              # bytes; <= 0: none
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [byte_ptr + start.to(tl.int64) * 16, size], dtype=tl.int32,
            is_pure=False, pack=1)
