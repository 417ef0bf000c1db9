"""The dense GEMM of a decode step as a bandwidth kernel: y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
for 1 <= M <= 8 tokens, on CUDA cores, reading every weight element from HBM once for all M.

W is row-major (nn.Linear's layout: N output rows of K), bf16, fp16 or fp32; x's rows are
contiguous; fp32 accumulation; y in x's dtype (bias added in fp32 before the cast).

dense_gemv_kernel   grid (cdiv(N, BLOCK_N), SPLIT_K)
    Program (n-block, s) owns BLOCK_N weight rows and split s's share of the K tiles. A K tile
    is loaded as [BLOCK_N, BLOCK_K // VEC, VEC]: one 16-byte vector (VEC elements) per thread
    and row, threads and warps along K, the BLOCK_N rows in each thread's registers. BLOCK_K is
    a multiple of VEC x 32 x num_warps, so a token's slice of x lies in the very threads that
    hold the weight columns it multiplies (no layout conversion: checked on sm_90 SASS, no
    shared memory in the K loop) and each thread loads it once for its BLOCK_N rows. Elements
    are widened to fp32 as (even, odd) column pairs: bf16 vectors are loaded as int32 words and
    widened with one shift or mask per element; fp16 / fp32 converted and split. Each of the
    BLOCK_M (1, 2, 4, 8) tokens has its own accumulator, fed from the same weight registers:
      ACC_PAIRS    [BLOCK_N, BLOCK_K // VEC, VEC // 2]: one FMA per product, reduced after
                   the loop (BLOCK_M x BLOCK_N x VEC / 2 registers);
      else         [BLOCK_N, BLOCK_K // VEC]: each step's products summed in the thread first
                   (fewer registers, 1.5 x the floating-point instructions).
    Token rows past M read row M - 1 (no masked loads) and are never written.
    PREFETCH loads the next K tile's weights before the FMAs on this one (registers double
    buffered): Triton's num_stages pipelining does not apply to loads that feed no tl.dot, so
    this is how a warp keeps a tile's loads in flight while it computes.
    SPLIT_K > 1 adds the fp32 partial rows into a workspace [M, N] with atomics; the program
    that arrives last at its n-block (moe_serve.kernels.moe.moe_tiles._arrive_last) reads them back while
    zeroing them, adds the bias and stores y: one launch, and the workspace is zero after every
    call (moe_serve.kernels.moe.moe_decode_launch.split_workspace, shared with the MoE decode path).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_serve.kernels.dense.configs import DEFAULT_SMS, Config, bucket, config_for, max_m, validate, vec
from moe_serve.kernels.moe.configs import device_file_name
from moe_serve.kernels.moe.launch import jit, launch
from moe_serve.kernels.moe.moe_decode_launch import split_workspace
from moe_serve.kernels.moe.moe_tiles import _arrive_last, _split_range, _take_row

MAX_M = max_m("bf16")               # tokens one launch serves (one accumulator each)
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def _pairs(ptrs, mask, BF16: tl.constexpr, ROWS: tl.constexpr, BKV: tl.constexpr, LANES: tl.constexpr):
    """The even and odd columns, fp32 [ROWS, BKV, LANES], of the 16-byte vectors at ptrs (vectors
    outside mask, which is constant along a vector, read as 0). BF16: ptrs [ROWS, BKV, LANES] are
    int32 words of two bf16 each, widened with one shift or mask per element; else ptrs
    [ROWS, BKV, 2 x LANES] are elements, converted and split."""
    if BF16:
        if mask is None:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=mask, other=0)
        even = (v << 16).to(tl.float32, bitcast=True)
        odd = (v & -65536).to(tl.float32, bitcast=True)
    else:
        if mask is None:
            v = tl.load(ptrs).to(tl.float32)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(v, (ROWS, BKV, LANES, 2)))
    return even, odd


@triton.jit
def _token(acc, we, wo, x_row, k0, ku, kv, K_U, EVEN_K: tl.constexpr, BF16: tl.constexpr,
           ACC_PAIRS: tl.constexpr, BKV: tl.constexpr, LANES: tl.constexpr):
    """One token's accumulator after the products of its x slice (x_row + k0 + ku, in load
    units; kv: the vectors' first units) with the weight tile's even / odd columns we, wo
    [BLOCK_N, BKV, LANES]."""
    xe, xo = _pairs(x_row + k0 + ku, None if EVEN_K else k0 + kv < K_U, BF16, 1, BKV, LANES)
    if ACC_PAIRS:
        acc = tl.fma(wo, xo, tl.fma(we, xe, acc))
    else:
        acc = acc + tl.sum(tl.fma(wo, xo, we * xe), axis=2)
    return acc


@triton.jit
def _row_sum(acc, ACC_PAIRS: tl.constexpr):
    """[BLOCK_N] fp32 dot products of one token from its accumulator."""
    if ACC_PAIRS:
        row = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        row = tl.sum(acc, axis=1)
    return row


@triton.jit
def _store(y_ptr, ws_ptr, bias, acc, m, M, N, offs_n, ACC_PAIRS: tl.constexpr,
           SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, FINAL: tl.constexpr, row_scale=None):
    """Token m's row: its fp32 partial into the workspace (SPLIT_K > 1, not FINAL), or the final
    row (x row_scale [BN], if given, + bias) into y (FINAL: the sums read back from the
    workspace; SPLIT_K 1: acc's)."""
    mask = offs_n < tl.where(m < M, N, 0)                             # [BN]: rows < N of tokens < M
    if FINAL:
        if SPLIT_K > 1:
            row = _take_row(ws_ptr + m * N + offs_n, mask, BLOCK_N)
        else:
            row = _row_sum(acc, ACC_PAIRS)
        if row_scale is not None:
            row = row * row_scale
        tl.store(y_ptr + m * N + offs_n, (row + bias).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ws_ptr + m * N + offs_n, _row_sum(acc, ACC_PAIRS), mask=mask, sem="relaxed",
                      scope="gpu")


@triton.jit
def _store_rows(y_ptr, ws_ptr, bias, a0, a1, a2, a3, a4, a5, a6, a7, M, N, offs_n, ACC_PAIRS: tl.constexpr,
                SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, FINAL: tl.constexpr):
    """_store of the program's BLOCK_M (1, 2, 4 or 8) tokens' rows (Triton holds no register arrays:
    one accumulator per token)."""
    _store(y_ptr, ws_ptr, bias, a0, 0, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
    if BLOCK_M > 1:
        _store(y_ptr, ws_ptr, bias, a1, 1, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
    if BLOCK_M > 2:
        _store(y_ptr, ws_ptr, bias, a2, 2, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
        _store(y_ptr, ws_ptr, bias, a3, 3, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
    if BLOCK_M > 4:
        _store(y_ptr, ws_ptr, bias, a4, 4, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
        _store(y_ptr, ws_ptr, bias, a5, 5, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
        _store(y_ptr, ws_ptr, bias, a6, 6, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)
        _store(y_ptr, ws_ptr, bias, a7, 7, M, N, offs_n, ACC_PAIRS, SPLIT_K, BLOCK_N, FINAL)


@jit(do_not_specialize=["M"])
def dense_gemv_kernel(
    # pointers (ws_ptr [>= M * N] fp32 and cnt_ptr [>= cdiv(N, BLOCK_N)] int32: the split
    # workspace, zero between calls; unused when SPLIT_K == 1; b_ptr [N] unused without bias)
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    # sizes (M tokens, the rows of x and y; N output rows of w; K its columns); w's row
    # stride (elements; x and y are contiguous)
    M, N, K, stride_wn,
    # meta
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, ACC_PAIRS: tl.constexpr,
    PREFETCH: tl.constexpr, BF16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    EL: tl.constexpr = 2 if BF16 else 1                              # elements per load unit
    UV: tl.constexpr = VEC // EL                                     # load units per vector
    BKV: tl.constexpr = BLOCK_K // VEC                               # vectors per row and tile
    TILE_U: tl.constexpr = BLOCK_K // EL                             # load units per row and tile
    LANES: tl.constexpr = VEC // 2                                   # (even, odd) pairs per vector
    wp = w_ptr.to(tl.pointer_type(tl.int32)) if BF16 else w_ptr
    xp = x_ptr.to(tl.pointer_type(tl.int32)) if BF16 else x_ptr
    K_U = K // EL                            # the launcher checked K % VEC: rows are whole vectors
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] output rows
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)                    # tail rows re-read row N-1
    kv = (tl.arange(0, BKV) * UV)[None, :, None]                      # [1, BKV, 1] vector starts
    ku = kv + tl.arange(0, UV)[None, None, :]                         # [1, BKV, UV] their units
    w_rows = tl.multiple_of(rows * (stride_wn // EL), UV)            # [BN] 16-byte aligned starts
    w_ptrs = wp + w_rows[:, None, None] + ku                         # [BN, BKV, UV]
    last = (M - 1).to(tl.int64) * K_U                                # row M-1 stands in past M
    x0 = xp + tl.multiple_of(tl.minimum(0 * K_U, last), UV)
    x1 = xp + tl.multiple_of(tl.minimum(1 * K_U, last), UV)
    x2 = xp + tl.multiple_of(tl.minimum(2 * K_U, last), UV)
    x3 = xp + tl.multiple_of(tl.minimum(3 * K_U, last), UV)
    x4 = xp + tl.multiple_of(tl.minimum(4 * K_U, last), UV)
    x5 = xp + tl.multiple_of(tl.minimum(5 * K_U, last), UV)
    x6 = xp + tl.multiple_of(tl.minimum(6 * K_U, last), UV)
    x7 = xp + tl.multiple_of(tl.minimum(7 * K_U, last), UV)
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
        ne, no = _pairs(w_ptrs + lo * TILE_U, lo * TILE_U + kv < tl.where(lo < hi, K_U, 0), BF16,
                        BLOCK_N, BKV, LANES)
    for kt in range(lo, hi):
        k0 = kt * TILE_U
        if PREFETCH:                   # this tile's weights came one step ago; load the next
            we, wo = ne, no
            ne, no = _pairs(w_ptrs + k0 + TILE_U, k0 + TILE_U + kv < tl.where(kt + 1 < hi, K_U, 0), BF16,
                            BLOCK_N, BKV, LANES)
        else:
            we, wo = _pairs(w_ptrs + k0, None if EVEN_K else k0 + kv < K_U, BF16, BLOCK_N, BKV, LANES)
        a0 = _token(a0, we, wo, x0, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
        if BLOCK_M > 1:
            a1 = _token(a1, we, wo, x1, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
        if BLOCK_M > 2:
            a2 = _token(a2, we, wo, x2, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
            a3 = _token(a3, we, wo, x3, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
        if BLOCK_M > 4:
            a4 = _token(a4, we, wo, x4, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
            a5 = _token(a5, we, wo, x5, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
            a6 = _token(a6, we, wo, x6, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)
            a7 = _token(a7, we, wo, x7, k0, ku, kv, K_U, EVEN_K, BF16, ACC_PAIRS, BKV, LANES)

    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if SPLIT_K > 1:                    # partial rows into the workspace; the last program goes on
        _store_rows(y_ptr, ws_ptr, bias, a0, a1, a2, a3, a4, a5, a6, a7, M, N, offs_n, ACC_PAIRS, SPLIT_K,
                    BLOCK_N, BLOCK_M, False)
        if not _arrive_last(cnt_ptr + pid_n, SPLIT_K):
            return
    _store_rows(y_ptr, ws_ptr, bias, a0, a1, a2, a3, a4, a5, a6, a7, M, N, offs_n, ACC_PAIRS, SPLIT_K,
                BLOCK_N, BLOCK_M, True)

def unsupported(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """None when dense_gemv can compute x [M, K] @ w[N, K]^T (+ bias [N]) as laid out, else why
    not: 1 <= M <= MAX_M; w and x in one 16/32-bit float dtype on one device; w's rows unit
    stride and 16-byte aligned (K and w's row stride multiples of VEC); x contiguous and
    16-byte aligned; bias a contiguous [N] vector of w's dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return f"shapes: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]"
    if not 1 <= x.shape[0] <= MAX_M:
        return f"tokens: M={x.shape[0]} is not in 1..{MAX_M}"
    if w.dtype not in DTYPES or x.dtype != w.dtype:
        return f"dtype: x {x.dtype}, w {w.dtype} (one of bf16, fp16, fp32)"
    if x.device != w.device or (bias is not None and bias.device != w.device):
        return "device: x, w and bias on different devices"
    v = vec(DTYPES[w.dtype])
    if x.shape[1] % v or w.stride(1) != 1 or w.stride(0) % v or w.data_ptr() % 16:
        return f"weight layout: rows must be unit stride, 16-byte aligned, K % {v} == 0"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return "x layout: contiguous and 16-byte aligned"
    if bias is not None and (tuple(bias.shape) != (w.shape[0],) or not bias.is_contiguous()
                             or bias.dtype != w.dtype):
        return f"bias: {tuple(bias.shape)} {bias.dtype} must be a contiguous {w.dtype} [N={w.shape[0]}]"
    return None


@functools.cache
def device_facts(device: torch.device) -> tuple[str, int]:
    """(config-table device name, SM count) of a device (the defaults on CPU)."""
    if device.type != "cuda":
        return "cpu", DEFAULT_SMS
    props = torch.cuda.get_device_properties(device)
    return device_file_name(props.name), props.multi_processor_count


def dense_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               cfg: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]) in x's dtype, fp32 accumulation, for
    1 <= M <= MAX_M (see unsupported); cfg: a moe_serve.kernels.dense.configs config (default: the tuned
    table's or the heuristic's for this shape, M and device); out: a contiguous [M, N] tensor of
    x's dtype to write into. One launch, no host sync, buffers sized from shapes only: CUDA-graph
    capturable."""
    why = unsupported(x, w, bias)
    if why is not None:
        raise ValueError(f"dense_gemv: {why}")
    (M, K), N = x.shape, w.shape[0]
    dt = DTYPES[w.dtype]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"dense_gemv: out {tuple(out.shape)} {out.dtype} must be a contiguous "
                         f"[{M}, {N}] {x.dtype}")
    if cfg is None:
        name, sms = device_facts(x.device)
        cfg = config_for(M, N, K, dt, name, sms)
    else:
        cfg = validate(cfg, dt)
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    ws, cnt = split_workspace(x.device, M * N, triton.cdiv(N, bn)) if split > 1 else (out, out)
    launch(dense_gemv_kernel, (triton.cdiv(N, bn), split),
           x, w, bias if bias is not None else out, out, ws, cnt, M, N, K, w.stride(0),
           HAS_BIAS=bias is not None, BLOCK_M=bucket(M), BLOCK_N=bn, BLOCK_K=bk, VEC=vec(dt),
           SPLIT_K=split, EVEN_K=K % bk == 0, ACC_PAIRS=cfg["ACC_PAIRS"], PREFETCH=cfg["PREFETCH"],
           BF16=dt == "bf16", num_warps=cfg["num_warps"], num_stages=1)
    return out
