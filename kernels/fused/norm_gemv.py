"""Residual add + RMSNorm in the prologue of the decode GEMV that consumes them, one launch:

    s            = x + residual                    (fp32; s = x without a residual)
    residual_out = s in x's dtype                  (with a residual)
    h            = rnd(rnd(s * rstd) * w_norm)     rstd = 1 / sqrt(mean(s^2) + eps), over fp32 s
    y            = h @ W^T (+ bias)                fp32 accumulation, y in x's dtype

for x, residual [M, K] (1 <= M <= MAX_M), w_norm [K], W [N, K]; rnd rounds to x's dtype. These
are vLLM's fused_add_rms_norm / rms_norm (vllm.ir.ops.layernorm, what RMSNorm.forward_native
runs): the residual rounded once, the variance over the unrounded fp32 sum, the normalised row
rounded to the weight's dtype before the weight multiply and the product rounded again. So y is
the GEMV of exactly the h vLLM's norm hands its next layer (the QKV projection after the input
norm; the router's gate after the post-attention norm, where WRITE_H also stores h [M, K] for
the experts).

norm_gemv_kernel   grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))
    moe_serve.kernels.dense.gemv's split-K GEMV (16-byte loads, the weight rows in registers, register
    prefetch of the next K tile, the self-clearing split workspace; see its doc), with a
    prologue and a different x operand. Program (n-block, split, token block) holds BLOCK_M
    (1, 2, 4, 8) tokens; M in 9..16 runs two token blocks of 8 (each reads the weight: the GEMV's
    accumulators are one register set per token).
    Prologue: the rstd of each of the program's tokens, from a pass over their whole rows of x
    (and residual). Issued after the first weight tile's prefetch, so the row reads overlap the
    weight stream's first loads.
    K loop: per tile, s = x + residual for the tile's columns, then the GEMV's FMAs on
      EXACT_H   h as above: the operand vLLM's unfused layer feeds its GEMM, bit for bit up to
                rstd's summation order (two roundings per element and token, in every program);
      else      s * w_norm in fp32, and rstd applied to each token's sums after the loop: h
                without its two roundings (vLLM's Inductor-compiled norm does not round between
                the two multiplies either), y within about one more rounding of EXACT_H's, and
                fewer instructions (sm_90 SASS, Qwen3's QKV at M = 8: 731 in the K loop
                against 1051).
    The programs of n-block 0 (one per split: between them every column once) also store
    residual_out and, with WRITE_H, h rounded as vLLM's norm rounds it: written once, out of
    place (x and residual are still being read by other programs), no extra pass.

Why the rows are re-read per program rather than a precomputed rstd: a precomputed rstd needs
a launch before this one (what fusing removes), unless the kernel before produces it (an
o_proj epilogue adding the sum of squares: the MoE chain's job). The re-read is BLOCK_M x K x
(1 or 2 tensors) elements per program against the BLOCK_N x K / SPLIT_K weight elements it
streams: x and residual are the same few KB for every program, so after the first program on
an SM they come from L1 (else L2), never HBM; what it can cost is latency at a program's start,
which the first tile's prefetch covers. Configs with few rows and a deep split (BLOCK_N 1,
SPLIT_K 8) re-read the most per weight byte. The larger cost is arithmetic: every n-block
redoes the norm on its columns of every token, amortised over its BLOCK_N weight rows. The
plain GEMV's configs (what serving_config takes) hold 2 rows at M = 8, where that K loop runs
~1050 instructions per thread for 2 weight vectors: issue-bound below HBM's rate by a rough
count, so the fused kernel likely wants more rows per program as M grows. Its own tables
(moe_serve.kernels.dense.configs, kind "norm_gemv", written by `moe-serve bench step --sweep`) list the
buckets where its best config beat the unfused chain; the ops (moe_serve.kernels.fused.ops) run it only
there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.dense.configs import NORM_GEMV, Config, bucket, config_for, load_table, validate, vec
from moe_serve.kernels.dense.gemv import DTYPES, _pairs, _store_rows, device_facts
from moe_serve.kernels.moe.launch import jit, launch
from moe_serve.kernels.moe.moe_decode_launch import split_workspace
from moe_serve.kernels.moe.moe_tiles import _arrive_last, _split_range

MAX_M = 16                          # tokens one launch serves
SERVED_EXACT_H = True               # the ops' operand: h as vLLM rounds it (bench_cases times both)
SERVED_MAX_M = MAX_M                # the ops' largest M on this kernel (above: row norm + F.linear)
TOKEN_BLOCK = 8                     # the GEMV's most accumulators per program
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _put(ptrs, even, odd, mask, DT: tl.constexpr, BF16: tl.constexpr, BKV: tl.constexpr, LANES: tl.constexpr):
    """Store fp32 (even, odd) column pairs [1, BKV, LANES], rounded to DT, at ptrs (the layout
    _pairs loads: int32 words of two bf16 with BF16, else elements [1, BKV, 2 x LANES])."""
    if BF16:
        lo = (even.to(DT).to(tl.float32).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        hi = odd.to(DT).to(tl.float32).to(tl.int32, bitcast=True) & -65536
        tl.store(ptrs, hi | lo, mask=mask)
    else:
        tl.store(ptrs, tl.reshape(tl.join(even, odd), (1, BKV, 2 * LANES)).to(DT), mask=mask)


@triton.jit
def _h(se, so, rstd, ne, no, DT: tl.constexpr):
    """h's (even, odd) columns rounded as vLLM's norm rounds them: rnd(rnd(s * rstd) * w)."""
    he = ((se * rstd).to(DT).to(tl.float32) * ne).to(DT).to(tl.float32)
    ho = ((so * rstd).to(DT).to(tl.float32) * no).to(DT).to(tl.float32)
    return he, ho


@triton.jit
def _token(acc, we, wo, ne, no, rstd, x_row, r_row, ro_row, h_row, keep, k0, ku, kv, K_U,
           HAS_RESIDUAL: tl.constexpr, WRITE_H: tl.constexpr, EXACT_H: tl.constexpr, EVEN_K: tl.constexpr,
           BF16: tl.constexpr, ACC_PAIRS: tl.constexpr, BKV: tl.constexpr, LANES: tl.constexpr, DT: tl.constexpr):
    """One token's accumulator after this K tile: the GEMV operand's columns (h with EXACT_H,
    else s * w, rstd applied to the sums later) from x, the residual, rstd and the norm weight's
    pairs ne, no, times the weight tile's (we, wo [BLOCK_N, BKV, LANES]); where keep (this
    program writes this token's columns), residual_out's and h's columns stored too."""
    in_k = k0 + kv < K_U
    se, so = _pairs(x_row + k0 + ku, None if EVEN_K else in_k, BF16, 1, BKV, LANES)
    if HAS_RESIDUAL:
        re, ro = _pairs(r_row + k0 + ku, None if EVEN_K else in_k, BF16, 1, BKV, LANES)
        se += re
        so += ro
    if EXACT_H:
        he, ho = _h(se, so, rstd, ne, no, DT)
    else:
        he = se * ne
        ho = so * no
    if keep:
        if HAS_RESIDUAL:
            _put(ro_row + k0 + ku, se, so, in_k, DT, BF16, BKV, LANES)
        if WRITE_H:
            if EXACT_H:
                _put(h_row + k0 + ku, he, ho, in_k, DT, BF16, BKV, LANES)
            else:
                xe, xo = _h(se, so, rstd, ne, no, DT)
                _put(h_row + k0 + ku, xe, xo, in_k, DT, BF16, BKV, LANES)
    if ACC_PAIRS:
        acc = tl.fma(wo, ho, tl.fma(we, he, acc))
    else:
        acc = acc + tl.sum(tl.fma(wo, ho, we * he), axis=2)
    return acc


@triton.jit
def _rstd(x_ptr, r_ptr, m0, M, K, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, RB: tl.constexpr):
    """[BLOCK_M] fp32 1 / sqrt(mean(s^2) + eps) of tokens m0.. over their whole rows (s = x +
    residual in fp32; rows past M read row M - 1)."""
    rows = tl.minimum(m0 + tl.arange(0, BLOCK_M), M - 1).to(tl.int64) * K     # [BM] row starts
    ss = tl.zeros((BLOCK_M, RB), dtype=tl.float32)
    for k0 in range(0, K, RB):
        offs = k0 + tl.arange(0, RB)
        ptrs = rows[:, None] + offs[None, :]                                 # [BM, RB]
        mask = (offs < K)[None, :]
        s = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(r_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        ss += s * s
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _pick(v, i: tl.constexpr, BLOCK_M: tl.constexpr):
    """Element i of v [BLOCK_M] as a scalar."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_M) == i, v, 0.0), axis=0)


@jit(do_not_specialize=["M"])
def norm_gemv_kernel(
    # pointers: x, residual [M, K] (residual unused without HAS_RESIDUAL), norm weight [K],
    # weight [N, K], bias [N] (unused without HAS_BIAS); outputs y [M, N], residual_out and h
    # [M, K] (unused without HAS_RESIDUAL / WRITE_H); the split workspace (ws [>= M * N] fp32,
    # cnt [>= token blocks x n-blocks] int32, zero between calls; unused when SPLIT_K == 1)
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, ro_ptr, h_ptr, ws_ptr, cnt_ptr,
    # sizes (M tokens; N output rows of w; K columns), w's row stride (elements; x, residual,
    # outputs contiguous), the norm's epsilon
    M, N, K, stride_wn, eps,
    # meta (ROW_BLOCK: the prologue's columns per step, one 16-byte vector per thread and token)
    HAS_RESIDUAL: tl.constexpr, WRITE_H: tl.constexpr, EXACT_H: tl.constexpr, HAS_BIAS: tl.constexpr,
    DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, ACC_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
    BF16: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m0 = tl.program_id(2) * BLOCK_M                                  # the token block's first token
    EL: tl.constexpr = 2 if BF16 else 1                              # elements per load unit
    UV: tl.constexpr = VEC // EL                                     # load units per vector
    BKV: tl.constexpr = BLOCK_K // VEC                               # vectors per row and tile
    TILE_U: tl.constexpr = BLOCK_K // EL                             # load units per row and tile
    LANES: tl.constexpr = VEC // 2                                   # (even, odd) pairs per vector
    wp = w_ptr.to(tl.pointer_type(tl.int32)) if BF16 else w_ptr
    xp = x_ptr.to(tl.pointer_type(tl.int32)) if BF16 else x_ptr
    rp = r_ptr.to(tl.pointer_type(tl.int32)) if BF16 else r_ptr
    np_ = nw_ptr.to(tl.pointer_type(tl.int32)) if BF16 else nw_ptr
    rop = ro_ptr.to(tl.pointer_type(tl.int32)) if BF16 else ro_ptr
    hp = h_ptr.to(tl.pointer_type(tl.int32)) if BF16 else h_ptr
    K_U = K // EL                            # the launcher checked K % VEC: rows are whole vectors
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] output rows
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)                    # tail rows re-read row N-1
    kv = (tl.arange(0, BKV) * UV)[None, :, None]                      # [1, BKV, 1] vector starts
    ku = kv + tl.arange(0, UV)[None, None, :]                         # [1, BKV, UV] their units
    w_rows = tl.multiple_of(rows * (stride_wn // EL), UV)            # [BN] 16-byte aligned starts
    w_ptrs = wp + w_rows[:, None, None] + ku                         # [BN, BKV, UV]
    last = (M - 1).to(tl.int64) * K_U                                # row M-1 stands in past M
    o0 = tl.multiple_of(tl.minimum((m0 + 0) * K_U, last), UV)        # token rows' starts (units)
    o1 = tl.multiple_of(tl.minimum((m0 + 1) * K_U, last), UV)
    o2 = tl.multiple_of(tl.minimum((m0 + 2) * K_U, last), UV)
    o3 = tl.multiple_of(tl.minimum((m0 + 3) * K_U, last), UV)
    o4 = tl.multiple_of(tl.minimum((m0 + 4) * K_U, last), UV)
    o5 = tl.multiple_of(tl.minimum((m0 + 5) * K_U, last), UV)
    o6 = tl.multiple_of(tl.minimum((m0 + 6) * K_U, last), UV)
    o7 = tl.multiple_of(tl.minimum((m0 + 7) * K_U, last), UV)
    writer = pid_n == 0                      # n-block 0's splits write residual_out and h
    if ACC_PAIRS:
        a0 = tl.zeros((BLOCK_N, BKV, LANES), dtype=tl.float32)
    else:
        a0 = tl.zeros((BLOCK_N, BKV), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    n_tiles = tl.cdiv(K, BLOCK_K)
    lo, hi = _split_range(n_tiles, tl.program_id(1), SPLIT_K)
    if PREFETCH:                       # masked loads: no tile past the split's own is read
        ne_w, no_w = _pairs(w_ptrs + lo * TILE_U, lo * TILE_U + kv < tl.where(lo < hi, K_U, 0), BF16,
                            BLOCK_N, BKV, LANES)
    rstd = _rstd(x_ptr, r_ptr, m0, M, K, eps, HAS_RESIDUAL, BLOCK_M, ROW_BLOCK)
    r0 = _pick(rstd, 0, BLOCK_M)             # each token's rstd (the block's tokens only)
    r1 = r0
    r2 = r0
    r3 = r0
    r4 = r0
    r5 = r0
    r6 = r0
    r7 = r0
    if BLOCK_M > 1:
        r1 = _pick(rstd, 1, BLOCK_M)
    if BLOCK_M > 2:
        r2 = _pick(rstd, 2, BLOCK_M)
        r3 = _pick(rstd, 3, BLOCK_M)
    if BLOCK_M > 4:
        r4 = _pick(rstd, 4, BLOCK_M)
        r5 = _pick(rstd, 5, BLOCK_M)
        r6 = _pick(rstd, 6, BLOCK_M)
        r7 = _pick(rstd, 7, BLOCK_M)
    for kt in range(lo, hi):
        k0 = kt * TILE_U
        if PREFETCH:                   # this tile's weights came one step ago; load the next
            we, wo = ne_w, no_w
            ne_w, no_w = _pairs(w_ptrs + k0 + TILE_U, k0 + TILE_U + kv < tl.where(kt + 1 < hi, K_U, 0), BF16,
                                BLOCK_N, BKV, LANES)
        else:
            we, wo = _pairs(w_ptrs + k0, None if EVEN_K else k0 + kv < K_U, BF16, BLOCK_N, BKV, LANES)
        ne, no = _pairs(np_ + k0 + ku, None if EVEN_K else k0 + kv < K_U, BF16, 1, BKV, LANES)
        a0 = _token(a0, we, wo, ne, no, r0, xp + o0, rp + o0, rop + o0, hp + o0, writer & (m0 < M), k0, ku,
                    kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
        if BLOCK_M > 1:
            a1 = _token(a1, we, wo, ne, no, r1, xp + o1, rp + o1, rop + o1, hp + o1, writer & (m0 + 1 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
        if BLOCK_M > 2:
            a2 = _token(a2, we, wo, ne, no, r2, xp + o2, rp + o2, rop + o2, hp + o2, writer & (m0 + 2 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
            a3 = _token(a3, we, wo, ne, no, r3, xp + o3, rp + o3, rop + o3, hp + o3, writer & (m0 + 3 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
        if BLOCK_M > 4:
            a4 = _token(a4, we, wo, ne, no, r4, xp + o4, rp + o4, rop + o4, hp + o4, writer & (m0 + 4 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
            a5 = _token(a5, we, wo, ne, no, r5, xp + o5, rp + o5, rop + o5, hp + o5, writer & (m0 + 5 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
            a6 = _token(a6, we, wo, ne, no, r6, xp + o6, rp + o6, rop + o6, hp + o6, writer & (m0 + 6 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)
            a7 = _token(a7, we, wo, ne, no, r7, xp + o7, rp + o7, rop + o7, hp + o7, writer & (m0 + 7 < M), k0,
                        ku, kv, K_U, HAS_RESIDUAL, WRITE_H, EXACT_H, EVEN_K, BF16, ACC_PAIRS, BKV, LANES, DT)

    if not EXACT_H:                    # the norm's scale, per token, on the sums of s * w * W
        a0 = a0 * r0
        if BLOCK_M > 1:
            a1 = a1 * r1
        if BLOCK_M > 2:
            a2 = a2 * r2
            a3 = a3 * r3
        if BLOCK_M > 4:
            a4 = a4 * r4
            a5 = a5 * r5
            a6 = a6 * r6
            a7 = a7 * r7
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y_blk = y_ptr + m0 * N                   # the token block's rows of y and of the workspace
    ws_blk = ws_ptr + m0 * N
    if SPLIT_K > 1:                    # partial rows into the workspace; the last program goes on
        _store_rows(y_blk, ws_blk, bias, a0, a1, a2, a3, a4, a5, a6, a7, M - m0, N, offs_n, ACC_PAIRS,
                    SPLIT_K, BLOCK_N, BLOCK_M, False)
        if not _arrive_last(cnt_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n, SPLIT_K):
            return
    _store_rows(y_blk, ws_blk, bias, a0, a1, a2, a3, a4, a5, a6, a7, M - m0, N, offs_n, ACC_PAIRS,
                SPLIT_K, BLOCK_N, BLOCK_M, True)


def unsupported(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None) -> str | None:
    """None when norm_gemv takes the call as laid out, else why not: 1 <= M <= MAX_M; x,
    residual, the norm weight, w (and bias) in one 16/32-bit float dtype on one device; x and
    residual contiguous [M, K], the norm weight [K], all 16-byte aligned; w's rows unit stride
    and 16-byte aligned (K and w's row stride multiples of VEC); bias a contiguous [N]."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return f"shapes: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]"
    M, K = x.shape
    if not 1 <= M <= MAX_M:
        return f"tokens: M={M} is not in 1..{MAX_M}"
    if residual is not None and tuple(residual.shape) != (M, K):
        return f"shapes: residual {tuple(residual.shape)} must be [M={M}, K={K}]"
    if tuple(norm_w.shape) != (K,):
        return f"shapes: norm weight {tuple(norm_w.shape)} must be [K={K}]"
    tensors = [t for t in (x, residual, norm_w, w, bias) if t is not None]
    if w.dtype not in DTYPES or any(t.dtype != w.dtype for t in tensors):
        return f"dtype: x {x.dtype}, w {w.dtype} and the others must share one of bf16, fp16, fp32"
    if any(t.device != w.device for t in tensors):
        return "device: the tensors are on different devices"
    v = vec(DTYPES[w.dtype])
    if K % v or w.stride(1) != 1 or w.stride(0) % v or w.data_ptr() % 16:
        return f"weight layout: rows must be unit stride, 16-byte aligned, K % {v} == 0"
    if any(not t.is_contiguous() or t.data_ptr() % 16 for t in (x, residual, norm_w) if t is not None):
        return "x layout: x, residual and the norm weight contiguous and 16-byte aligned"
    if bias is not None and (tuple(bias.shape) != (w.shape[0],) or not bias.is_contiguous()):
        return f"bias: {tuple(bias.shape)} must be a contiguous [N={w.shape[0]}]"
    return None


def tuned_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> Config | None:
    """The fused kernel's own tuned config for M's token block (its "norm_gemv" table on this
    device), or None: no table lists the bucket, so nothing measured it faster than the unfused
    chain (the row norm, then the GEMM)."""
    name, _ = device_facts(device)
    table = load_table(N, K, DTYPES[dtype], name, NORM_GEMV)
    return table.get(bucket(min(M, TOKEN_BLOCK))) if table else None


def serving_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> Config:
    """The config M tokens run: the fused kernel's tuned table's, else the dense GEMV's (its tuned
    table for this shape and the token block's bucket, else its heuristic)."""
    name, sms = device_facts(device)
    return tuned_config(M, N, K, dtype, device) or config_for(min(M, TOKEN_BLOCK), N, K, DTYPES[dtype], name, sms)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
              w: torch.Tensor, bias: torch.Tensor | None = None, write_h: bool = False,
              cfg: Config | None = None, exact_h: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y [M, N], residual_out [M, K] or None without a residual, h [M, K] or None unless
    write_h) for x [M, K], residual [M, K] or None, the norm's weight [K] and eps, the GEMV's
    weight w [N, K] and bias [N] (see the module doc; unsupported lists what it takes; it raises
    ValueError otherwise, M > MAX_M included: the caller keeps the unfused path there);
    exact_h: the GEMV's operand is h as vLLM's norm rounds it (else s * w, rstd on the sums). One
    launch, fresh outputs, no host sync: CUDA-graph capturable."""
    why = unsupported(x, residual, norm_w, w, bias)
    if why is not None:
        raise ValueError(f"norm_gemv: {why}")
    (M, K), N = x.shape, w.shape[0]
    dt = DTYPES[w.dtype]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    h = torch.empty_like(x) if write_h else None
    cfg = serving_config(M, N, K, x.dtype, x.device) if cfg is None else validate(cfg, dt)
    bm = bucket(min(M, TOKEN_BLOCK))
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    grid = (triton.cdiv(N, bn), split, triton.cdiv(M, bm))
    ws, cnt = split_workspace(x.device, M * N, grid[0] * grid[2]) if split > 1 else (y, y)
    launch(norm_gemv_kernel, grid,
           x, residual if residual is not None else x, norm_w, w, bias if bias is not None else y, y,
           res_out if res_out is not None else y, h if h is not None else y, ws, cnt,
           M, N, K, w.stride(0), float(eps),
           HAS_RESIDUAL=residual is not None, WRITE_H=write_h, EXACT_H=exact_h, HAS_BIAS=bias is not None,
           DT=TL_DTYPES[x.dtype], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, VEC=vec(dt), SPLIT_K=split,
           EVEN_K=K % bk == 0, ACC_PAIRS=cfg["ACC_PAIRS"], PREFETCH=cfg["PREFETCH"], BF16=dt == "bf16",
           ROW_BLOCK=vec(dt) * 32 * cfg["num_warps"] // bm, num_warps=cfg["num_warps"], num_stages=1)
    return y, res_out, h
