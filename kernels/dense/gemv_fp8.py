"""The dense decode GEMV of FP8 checkpoints: y[M, N] = x[M, K] @ dequant(Wq[N, K])^T (+ bias) for
1 <= M <= 16 tokens, on CUDA cores, the FP8 weights and their scales streamed in one pass and
dequantized in registers (W8A16: x stays in its float dtype, fp32 accumulation).

Wq is float8_e4m3fn with unit stride along K (rows 16-byte aligned: K and the row stride multiples
of 16); x bf16, fp16 or fp32, contiguous; y in x's dtype; bias [N] of x's dtype, added in fp32.
Scales (float32), read in the same pass as the weights:
    SCALE 1  per tensor: one value;
    SCALE 2  per channel: [N'] or [N', 1] (N' >= N: vLLM's CUTLASS path pads N to 16);
    SCALE 3  per [GROUP_N, GROUP_K] block: [>= cdiv(N, GROUP_N), >= cdiv(K, GROUP_K)], any
             strides (vLLM's weight_scale_inv, DeepGEMM's MN-major copy of it included).

dense_gemv_fp8_kernel   grid (cdiv(N, BLOCK_N), SPLIT_K)
    The layout of moe_serve.kernels.dense.gemv: program (n-block, s) owns BLOCK_N weight rows and split
    s's share of the K tiles; a K tile is [BLOCK_N, BLOCK_K // 16, 16]: one 16-byte vector (16
    fp8) per thread and row, threads and warps along K, the rows in each thread's registers
    (BLOCK_K a multiple of 16 x 32 x num_warps). A vector's 16 x values are 32 bytes of bf16 /
    fp16 (64 of fp32), so each token's slice is read as two half vectors of 8 elements, each one
    16-byte load (bf16 as int32 words, widened by integer ops) in the thread that holds the
    weights it multiplies; the weight vector is converted to fp32 and split into the same
    (half, even / odd) lanes [BLOCK_N, BLOCK_K // 16, 4]. Each of the BLOCK_M (1..16) tokens has
    its own accumulator (ACC_PAIRS: 4 lanes, one FMA per product; else the vector's products
    summed first). Per-tensor and per-channel scales multiply the finished row; block scales are
    one value per (program, vector) -- the program's rows lie in one GROUP_N block (GROUP_N %
    BLOCK_N == 0) and a vector in one GROUP_K group -- applied to the x half vectors when
    BLOCK_N >= BLOCK_M (16 x BLOCK_M multiplies per vector) and to the weight vectors otherwise
    (16 x BLOCK_N). PREFETCH keeps the next tile's raw fp8 vectors in registers (4 words per row)
    while this tile's products run; SPLIT_K > 1 reduces through the self-clearing workspace, as
    moe_serve.kernels.dense.gemv does. Token rows past M read row M - 1 and are never written.

What the GPU decides (bench/experts/dense.py times every bucket against vLLM's FP8 linear and
writes a table only where ours won): up to which M W8A16 on CUDA cores keeps up with HBM. Each fp8
byte costs M FMAs, M / BLOCK_N widenings of x and ~1.5 conversions: the sm_90 SASS of the default
configs' K loop holds ~6 instructions per weight byte at M = 1 and ~41 at M = 16, against an
H100's ~10 per byte at its streaming rate (~30e12 thread instructions/s for ~3e12 bytes/s), so
from M ~ 4 on the kernel is bound by instruction issue, not HBM; there the alternative is to
quantize x inside the kernel and run fp8 MMAs (moe_serve.kernels.moe.moe_decode's Swap-AB form), which this
module does not build. A static activation scale of the checkpoint is
not applied (x is never quantized: the result is the dequantized weights' exact product, vLLM's
within its activation rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.dense.configs import Config, bucket, config_for, fp8_key, validate
from moe_serve.kernels.dense.gemv import DTYPES, _pairs, _store, device_facts
from moe_serve.kernels.moe.launch import jit, launch
from moe_serve.kernels.moe.moe_decode_launch import split_workspace
from moe_serve.kernels.moe.moe_tiles import _arrive_last, _split_range

FP8 = torch.float8_e4m3fn
MAX_M = 16                          # tokens one launch serves (one accumulator each)
VEC = 16                            # fp8 weights per 16-byte vector
SCALE_TENSOR, SCALE_CHANNEL, SCALE_BLOCK = 1, 2, 3


@triton.jit
def _w_lanes(raw, s, SCALE_W: tl.constexpr, BLOCK_N: tl.constexpr, BKV: tl.constexpr):
    """A tile's fp8 vectors raw [BLOCK_N, BKV, 16] as fp32 (half, even / odd) lanes, each
    [BLOCK_N, BKV, 4]: lo-even, lo-odd, hi-even, hi-odd (elements 2j, 2j + 1, 8 + 2j, 9 + 2j);
    SCALE_W: times the vectors' block scales s [1, BKV, 1]."""
    w = raw.to(tl.float16)                     # exact: e4m3 values are all fp16 values
    lo, hi = tl.split(tl.permute(tl.reshape(w, (BLOCK_N, BKV, 2, 8)), (0, 1, 3, 2)))
    le, lo_ = tl.split(tl.reshape(lo, (BLOCK_N, BKV, 4, 2)))
    he, ho = tl.split(tl.reshape(hi, (BLOCK_N, BKV, 4, 2)))
    le, lo_, he, ho = le.to(tl.float32), lo_.to(tl.float32), he.to(tl.float32), ho.to(tl.float32)
    if SCALE_W:
        le, lo_, he, ho = le * s, lo_ * s, he * s, ho * s
    return le, lo_, he, ho


@triton.jit
def _token(acc, wle, wlo, whe, who, x_ptrs, mask, s, HU: tl.constexpr, X_BF16: tl.constexpr,
           SCALE_X: tl.constexpr, ACC_PAIRS: tl.constexpr, BKV: tl.constexpr):
    """One token's accumulator after its x half vectors at x_ptrs and x_ptrs + HU (load units;
    [1, BKV, HU]) times the weight lanes; SCALE_X: x times the vectors' block scales s."""
    xle, xlo = _pairs(x_ptrs, mask, X_BF16, 1, BKV, 4)
    xhe, xho = _pairs(x_ptrs + HU, mask, X_BF16, 1, BKV, 4)
    if SCALE_X:
        xle, xlo, xhe, xho = xle * s, xlo * s, xhe * s, xho * s
    if ACC_PAIRS:
        acc = tl.fma(who, xho, tl.fma(whe, xhe, tl.fma(wlo, xlo, tl.fma(wle, xle, acc))))
    else:
        acc = acc + tl.sum(tl.fma(who, xho, tl.fma(whe, xhe, tl.fma(wlo, xlo, wle * xle))), axis=2)
    return acc


@triton.jit
def _store_rows(y_ptr, ws_ptr, bias, row_scale, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12,
                a13, a14, a15, M, N, offs_n, ACC_PAIRS: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, FINAL: tl.constexpr):
    """moe_serve.kernels.dense.gemv._store of the program's BLOCK_M (1, 2, 4, 8 or 16) tokens' rows."""
    _store(y_ptr, ws_ptr, bias, a0, 0, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
    if BLOCK_M > 1:
        _store(y_ptr, ws_ptr, bias, a1, 1, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
    if BLOCK_M > 2:
        _store(y_ptr, ws_ptr, bias, a2, 2, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a3, 3, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
    if BLOCK_M > 4:
        _store(y_ptr, ws_ptr, bias, a4, 4, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a5, 5, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a6, 6, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a7, 7, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
    if BLOCK_M > 8:
        _store(y_ptr, ws_ptr, bias, a8, 8, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a9, 9, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a10, 10, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a11, 11, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a12, 12, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a13, 13, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a14, 14, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)
        _store(y_ptr, ws_ptr, bias, a15, 15, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL, row_scale)


@jit(do_not_specialize=["M"])
def dense_gemv_fp8_kernel(
    # pointers (s_ptr: the fp32 weight scales; ws_ptr [>= M * N] fp32 and cnt_ptr
    # [>= cdiv(N, BLOCK_N)] int32: the split workspace, zero between calls, unused when
    # SPLIT_K == 1; b_ptr [N] unused without bias)
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    # sizes (M tokens, N output rows, K columns); w's row stride (elements); the scales' strides
    # (per channel: stride_sn per row; block: per row block and per K group)
    M, N, K, stride_wn, stride_sn, stride_sk,
    # meta
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, ACC_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
    X_BF16: tl.constexpr, SCALE: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    XEL: tl.constexpr = 2 if X_BF16 else 1                           # x elements per load unit
    HU: tl.constexpr = 8 // XEL                                      # x units per half vector
    BKV: tl.constexpr = BLOCK_K // 16                                # vectors per row and tile
    SCALE_W: tl.constexpr = SCALE == 3 and BLOCK_N < BLOCK_M         # block scales on w, else x
    SCALE_X: tl.constexpr = SCALE == 3 and BLOCK_N >= BLOCK_M
    xp = x_ptr.to(tl.pointer_type(tl.int32)) if X_BF16 else x_ptr
    K_X = K // XEL
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] output rows
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)                    # tail rows re-read row N-1
    kv = (tl.arange(0, BKV) * 16)[None, :, None]                     # [1, BKV, 1] vector starts
    w_ptrs = w_ptr + tl.multiple_of(rows * stride_wn, 16)[:, None, None] + kv \
        + tl.arange(0, 16)[None, None, :]                            # [BN, BKV, 16]
    xu = kv // XEL + tl.arange(0, HU)[None, None, :]                  # [1, BKV, HU] lo halves
    s_row = s_ptr + ((pid_n * BLOCK_N) // GROUP_N) * stride_sn if SCALE == 3 else s_ptr
    last = (M - 1).to(tl.int64) * K_X                                # row M-1 stands in past M
    x0 = xp + tl.multiple_of(tl.minimum(0 * K_X, last), HU) + xu
    x1 = xp + tl.multiple_of(tl.minimum(1 * K_X, last), HU) + xu
    x2 = xp + tl.multiple_of(tl.minimum(2 * K_X, last), HU) + xu
    x3 = xp + tl.multiple_of(tl.minimum(3 * K_X, last), HU) + xu
    x4 = xp + tl.multiple_of(tl.minimum(4 * K_X, last), HU) + xu
    x5 = xp + tl.multiple_of(tl.minimum(5 * K_X, last), HU) + xu
    x6 = xp + tl.multiple_of(tl.minimum(6 * K_X, last), HU) + xu
    x7 = xp + tl.multiple_of(tl.minimum(7 * K_X, last), HU) + xu
    x8 = xp + tl.multiple_of(tl.minimum(8 * K_X, last), HU) + xu
    x9 = xp + tl.multiple_of(tl.minimum(9 * K_X, last), HU) + xu
    x10 = xp + tl.multiple_of(tl.minimum(10 * K_X, last), HU) + xu
    x11 = xp + tl.multiple_of(tl.minimum(11 * K_X, last), HU) + xu
    x12 = xp + tl.multiple_of(tl.minimum(12 * K_X, last), HU) + xu
    x13 = xp + tl.multiple_of(tl.minimum(13 * K_X, last), HU) + xu
    x14 = xp + tl.multiple_of(tl.minimum(14 * K_X, last), HU) + xu
    x15 = xp + tl.multiple_of(tl.minimum(15 * K_X, last), HU) + xu
    if ACC_PAIRS:
        a0 = tl.zeros((BLOCK_N, BKV, 4), dtype=tl.float32)
    else:
        a0 = tl.zeros((BLOCK_N, BKV), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    a8 = a0
    a9 = a0
    a10 = a0
    a11 = a0
    a12 = a0
    a13 = a0
    a14 = a0
    a15 = a0
    n_tiles = tl.cdiv(K, BLOCK_K)
    lo, hi = _split_range(n_tiles, tl.program_id(1), SPLIT_K)
    if PREFETCH:                       # masked loads: no tile past the split's own is read
        nxt = tl.load(w_ptrs + lo * BLOCK_K, mask=lo * BLOCK_K + kv < tl.where(lo < hi, K, 0), other=0.0)
    for kt in range(lo, hi):
        k0 = kt * BLOCK_K
        k_mask = None if EVEN_K else k0 + kv < K                     # [1, BKV, 1] whole vectors
        if PREFETCH:                   # this tile's weights came one step ago; load the next
            raw = nxt
            nxt = tl.load(w_ptrs + k0 + BLOCK_K, mask=k0 + BLOCK_K + kv < tl.where(kt + 1 < hi, K, 0),
                          other=0.0)
        elif EVEN_K:
            raw = tl.load(w_ptrs + k0)
        else:
            raw = tl.load(w_ptrs + k0, mask=k_mask, other=0.0)
        s = 1.0
        if SCALE == 3:                 # [1, BKV, 1]: each vector's K group, this row block
            g = (k0 + kv) // GROUP_K
            if EVEN_K:
                s = tl.load(s_row + g * stride_sk)
            else:
                s = tl.load(s_row + g * stride_sk, mask=k_mask, other=0.0)
        wle, wlo, whe, who = _w_lanes(raw, s, SCALE_W, BLOCK_N, BKV)
        xk = k0 // XEL
        a0 = _token(a0, wle, wlo, whe, who, x0 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
        if BLOCK_M > 1:
            a1 = _token(a1, wle, wlo, whe, who, x1 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
        if BLOCK_M > 2:
            a2 = _token(a2, wle, wlo, whe, who, x2 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a3 = _token(a3, wle, wlo, whe, who, x3 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
        if BLOCK_M > 4:
            a4 = _token(a4, wle, wlo, whe, who, x4 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a5 = _token(a5, wle, wlo, whe, who, x5 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a6 = _token(a6, wle, wlo, whe, who, x6 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a7 = _token(a7, wle, wlo, whe, who, x7 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
        if BLOCK_M > 8:
            a8 = _token(a8, wle, wlo, whe, who, x8 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a9 = _token(a9, wle, wlo, whe, who, x9 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a10 = _token(a10, wle, wlo, whe, who, x10 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a11 = _token(a11, wle, wlo, whe, who, x11 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a12 = _token(a12, wle, wlo, whe, who, x12 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a13 = _token(a13, wle, wlo, whe, who, x13 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a14 = _token(a14, wle, wlo, whe, who, x14 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)
            a15 = _token(a15, wle, wlo, whe, who, x15 + xk, k_mask, s, HU, X_BF16, SCALE_X, ACC_PAIRS, BKV)

    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    row_scale = None
    if SCALE == 1:
        row_scale = tl.zeros((BLOCK_N,), dtype=tl.float32) + tl.load(s_ptr)
    elif SCALE == 2:
        row_scale = tl.load(s_ptr + rows * stride_sn)
    if SPLIT_K > 1:                    # partial rows into the workspace; the last program goes on
        _store_rows(y_ptr, ws_ptr, bias, row_scale, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12,
                    a13, a14, a15, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, BLOCK_M, False)
        if not _arrive_last(cnt_ptr + pid_n, SPLIT_K):
            return
    _store_rows(y_ptr, ws_ptr, bias, row_scale, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12,
                a13, a14, a15, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, BLOCK_M, True)


def scale_layout(scale: torch.Tensor, N: int, K: int,
                 block: tuple[int, int] | None) -> tuple[int, int, int] | str:
    """(SCALE, stride_sn, stride_sk) of a float32 weight scale for an [N, K] weight, or why the
    kernel cannot read it: one value (per tensor); [N'] or [N', 1] with N' >= N (per channel);
    with block (bn, bk) a 2-D [>= cdiv(N, bn), >= cdiv(K, bk)] of any strides."""
    if scale.dtype != torch.float32:
        return f"scale dtype {scale.dtype} (float32 only; e8m0 block scales stay vLLM's)"
    if block is not None:
        bn, bk = block
        if bn < 1 or bk < VEC or bk % VEC:
            return f"block {block}: bk must be a multiple of {VEC} (a vector lies in one K group)"
        if scale.dim() != 2 or scale.shape[0] < -(-N // bn) or scale.shape[1] < -(-K // bk):
            return f"block scale {tuple(scale.shape)} must cover [{-(-N // bn)}, {-(-K // bk)}]"
        return SCALE_BLOCK, scale.stride(0), scale.stride(1)
    if scale.numel() == 1:
        return SCALE_TENSOR, 0, 0
    if scale.dim() in (1, 2) and scale.shape[0] >= N and scale.numel() == scale.shape[0]:
        return SCALE_CHANNEL, scale.stride(0), 0
    return f"scale {tuple(scale.shape)}: one value, or [N'] / [N', 1] with N' >= N={N}"


def unsupported(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                block: tuple[int, int] | None = None) -> str | None:
    """None when dense_gemv_fp8 can compute x [M, K] @ dequant(w [N, K])^T (+ bias [N]) as laid
    out, else why not: 1 <= M <= MAX_M; w float8_e4m3fn, x bf16 / fp16 / fp32, one device; w's
    rows unit stride and 16-byte aligned (K and the row stride multiples of 16); x contiguous and
    16-byte aligned; the scale as scale_layout reads it; bias a contiguous [N] of x's dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return f"shapes: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]"
    if not 1 <= x.shape[0] <= MAX_M:
        return f"tokens: M={x.shape[0]} is not in 1..{MAX_M}"
    if w.dtype != FP8 or x.dtype not in DTYPES:
        return f"dtype: x {x.dtype}, w {w.dtype} (x bf16, fp16 or fp32; w float8_e4m3fn)"
    if any(t is not None and t.device != w.device for t in (x, scale, bias)):
        return "device: x, w, scale and bias on different devices"
    (N, K) = w.shape
    if K % VEC or w.stride(1) != 1 or w.stride(0) % VEC or w.data_ptr() % 16:
        return f"weight layout: rows must be unit stride, 16-byte aligned, K % {VEC} == 0"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return "x layout: contiguous and 16-byte aligned"
    layout = scale_layout(scale, N, K, block)
    if isinstance(layout, str):
        return layout
    if bias is not None and (tuple(bias.shape) != (N,) or not bias.is_contiguous() or bias.dtype != x.dtype):
        return f"bias: {tuple(bias.shape)} {bias.dtype} must be a contiguous {x.dtype} [N={N}]"
    return None


def dense_gemv_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None, cfg: Config | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (w [N, K] fp8 dequantized by `scale`)^T (+ bias [N]) in x's dtype,
    fp32 accumulation, for 1 <= M <= MAX_M (see unsupported); block: (bn, bk) of block scales
    (None: per tensor or per channel, by the scale's size); cfg: a moe_serve.kernels.dense.configs config
    (default: the tuned table's or the heuristic's for this shape, M and device); out: a
    contiguous [M, N] of x's dtype. One launch, no host sync, buffers sized from shapes only:
    CUDA-graph capturable."""
    why = unsupported(x, w, scale, bias, block)
    if why is not None:
        raise ValueError(f"dense_gemv_fp8: {why}")
    (M, K), N = x.shape, w.shape[0]
    mode, stride_sn, stride_sk = scale_layout(scale, N, K, block)
    key = fp8_key(block, mode == SCALE_CHANNEL)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"dense_gemv_fp8: out {tuple(out.shape)} {out.dtype} must be a contiguous "
                         f"[{M}, {N}] {x.dtype}")
    if cfg is None:
        name, sms = device_facts(x.device)
        cfg = config_for(M, N, K, key, name, sms)
    else:
        cfg = validate(cfg, key)
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    ws, cnt = split_workspace(x.device, M * N, triton.cdiv(N, bn)) if split > 1 else (out, out)
    launch(dense_gemv_fp8_kernel, (triton.cdiv(N, bn), split),
           x, w, scale, bias if bias is not None else out, out, ws, cnt, M, N, K, w.stride(0), stride_sn, stride_sk,
           HAS_BIAS=bias is not None, BLOCK_M=bucket(M, key), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
           EVEN_K=K % bk == 0, ACC_PAIRS=cfg["ACC_PAIRS"], PREFETCH=cfg["PREFETCH"], X_BF16=x.dtype == torch.bfloat16,
           SCALE=mode, GROUP_N=block[0] if block else 1, GROUP_K=block[1] if block else 1,
           num_warps=cfg["num_warps"], num_stages=1)
    return out
