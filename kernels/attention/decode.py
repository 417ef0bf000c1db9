"""Paged decode attention: one query token per sequence, grouped-query heads, the context split
across programs and the splits combined by the last one to finish, in one launch.

For q [B, Hq, D] and sequence b's context of L = seq_lens[b] tokens in vLLM's paged cache
(key_cache / value_cache [num_blocks, block_size, Hkv, D]; token t of sequence b at block
block_table[b, t // block_size], slot t % block_size), query head i reading kv head i // G
(G = Hq / Hkv):

    out[b, i] = softmax(scale * K[b, :L, i // G] q[b, i]) V[b, :L, i // G]

in fp32 (the probabilities rounded to the cache's dtype for the P V product, as flash attention
does), rounded once to q's dtype.

decode_attention_kernel   grid (B, Hkv, S)
    Program (b, h, s) holds the G query heads of kv head h (padded to BLOCK_G >= 16 rows for
    tl.dot) and split s of the context: chunk = max(MIN_CHUNK, cdiv(L, S) rounded up to BLOCK_N)
    tokens per split, so a short context uses few splits and the programs past them return at
    once. It streams its tokens BLOCK_N at a time with an online softmax (exp2). Alone (one
    active split) it writes out; else it stores its partials (running max, sum, unnormalised
    accumulator) and takes a ticket on the (b, h) counter (atomic, acq_rel): the last active
    split to arrive combines every split's partials into out and resets the counter to 0 for the
    next launch. No host sync, grid fixed by B: CUDA-graph capturable, seq_lens changing between
    replays. Not here: sliding windows, logit soft-capping, ALiBi, attention sinks, a quantized
    cache (`unsupported` names the caller's case).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_serve.kernels.fused.norm_gemv import TL_DTYPES
from moe_serve.kernels.moe.launch import jit, launch

MAX_SPLITS = 64           # splits per (sequence, kv head) at most
MIN_CHUNK = 32            # tokens per split at least
BLOCK_N = 32              # tokens per tile
SPLIT_TILE = 1            # splits the combine reads at once (1: the fastest of 1, 4, 8 on an H100, bench/RESULTS.md)
NUM_WARPS = 4             # per program for a 16-bit cache; twice that for fp32 (its tiles' registers)
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}   # per device: every counter buffer made (kept alive)


@jit(do_not_specialize=["S", "block_size", "stride_bt"])
def decode_attention_kernel(
    # pointers: q [B, Hq, D], key / value cache [blocks, block_size, Hkv, D], block_table
    # [B, max_blocks] int32, seq_lens [B] int32, out [B, Hq, D]; scratch: partials [B, Hkv, S,
    # BLOCK_G, BLOCK_D] fp32, (max, sum) [B, Hkv, S, BLOCK_G, 2] fp32, counters [>= B * Hkv] int32 (zero)
    q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, out_ptr, part_ptr, ml_ptr, count_ptr,
    # strides (elements): q's sequence and head, out's, the block table's row, the cache's block,
    # slot and head
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    # sizes: splits per (sequence, kv head), the cache's block size; softmax scale times log2(e)
    S, block_size, scale_log2,
    # meta
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, IEEE: tl.constexpr, MAX_S: tl.constexpr, SPLIT_TILE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    hkv = tl.num_programs(1)
    L = tl.load(len_ptr + b)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(L, S), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    active = tl.cdiv(L, chunk)
    if s < active:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gd = (g < G)[:, None] & (d < D)[None, :]
        heads = h * G + g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd,
                    other=0.0)                                                       # [BLOCK_G, BLOCK_D]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = s * chunk
        end = tl.minimum(start + chunk, L)
        n = tl.arange(0, BLOCK_N)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + n
            in_t = t < end
            page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + t // block_size, mask=in_t, other=0)
            row = page.to(tl.int64) * stride_cb + (t % block_size) * stride_cs + h * stride_ch   # [BLOCK_N]
            nd = in_t[:, None] & (d < D)[None, :]
            k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=nd, other=0.0)             # [BLOCK_N, BLOCK_D]
            v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=nd, other=0.0)             # issued with K
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))                                                  # [BLOCK_G, BLOCK_N]
            qk = tl.where(in_t[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            den = den * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        if active == 1:
            tl.store(o_ptrs, (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=gd)
        else:
            pair = (b * hkv + h).to(tl.int64)
            split = pair * S + s
            tl.store(part_ptr + split * BLOCK_G * BLOCK_D + g[:, None] * BLOCK_D + d[None, :], acc, mask=gd)
            tl.store(ml_ptr + (split * BLOCK_G + g) * 2, m, mask=g < G)
            tl.store(ml_ptr + (split * BLOCK_G + g) * 2 + 1, den, mask=g < G)
            tl.debug_barrier()                                   # every thread's partials before the ticket
            ticket = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if ticket == active - 1:                             # the last split: combine
                tl.store(count_ptr + pair, 0)
                first = pair * S
                jj = tl.arange(0, MAX_S)
                m_all = tl.load(ml_ptr + ((first + jj)[:, None] * BLOCK_G + g[None, :]) * 2,
                                mask=(jj < active)[:, None] & (g < G)[None, :], other=float("-inf"),
                                cache_modifier=".cg")
                top = tl.where(g < G, tl.max(m_all, 0), 0.0)                             # [BLOCK_G]
                total = tl.zeros([BLOCK_G], tl.float32)
                num = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
                for j0 in range(0, active, SPLIT_TILE):                 # SPLIT_TILE splits' partials at once
                    j = j0 + tl.arange(0, SPLIT_TILE)
                    ok = (j < active)[:, None] & (g < G)[None, :]                       # [SPLIT_TILE, BLOCK_G]
                    at = (first + j)[:, None] * BLOCK_G + g[None, :]                   # [SPLIT_TILE, BLOCK_G]
                    w = tl.exp2(tl.load(ml_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                                - top[None, :])
                    total += tl.sum(w * tl.load(ml_ptr + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg"), 0)
                    part = tl.load(part_ptr + at[:, :, None] * BLOCK_D + d[None, None, :],
                                   mask=ok[:, :, None] & (d < D)[None, None, :], other=0.0,
                                   cache_modifier=".cg")                               # [SPLIT_TILE, BLOCK_G, BLOCK_D]
                    num += tl.sum(w[:, :, None] * part, 0)
                total = tl.where(g < G, total, 1.0)                   # padded rows: no 0 / 0
                tl.store(o_ptrs, (num / total[:, None]).to(out_ptr.dtype.element_ty), mask=gd)


def unsupported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor) -> str | None:
    """None when decode_attention takes the call as laid out, else why not."""
    if q.dim() != 3 or q.stride(2) != 1:
        return f"q {tuple(q.shape)} must be [B, Hq, D], unit stride along D"
    B, Hq, D = q.shape
    if q.dtype not in TL_DTYPES:
        return f"dtype: q {q.dtype} (one of bf16, fp16, fp32)"
    if key_cache.dim() != 4 or key_cache.shape[3] != D or value_cache.shape != key_cache.shape:
        return f"key / value cache {tuple(key_cache.shape)} must be [blocks, block_size, Hkv, D={D}], one shape"
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        return "key / value cache: one layout, unit stride along D"
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        return f"cache dtype {key_cache.dtype}: q's ({q.dtype}), no quantized cache"
    Hkv = key_cache.shape[2]
    if Hq % Hkv:
        return f"Hq = {Hq} query heads are not a multiple of Hkv = {Hkv}"
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32 or (
            block_table.stride(1) != 1):
        return f"block_table {tuple(block_table.shape)} {block_table.dtype} must be int32 [B={B}, max_blocks], unit stride"
    if tuple(seq_lens.shape) != (B,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        return f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype} must be a contiguous int32 [B={B}]"
    if any(t.device != q.device for t in (key_cache, value_cache, block_table, seq_lens)):
        return "device: the tensors are on different devices"
    return None


def default_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): enough programs for two per SM (8 SMs assumed off a GPU),
    at most MAX_SPLITS."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(1, batch * kv_heads))))


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters on device, reused across calls (the kernel
    leaves it zero); a larger one is added when needed and the old ones kept, since a captured
    CUDA graph may still point at them."""
    made = _COUNTERS.setdefault(device, [])
    if not made or made[-1].numel() < n:
        made.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return made[-1]


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int = BLOCK_N, min_chunk: int = MIN_CHUNK,
                     num_warps: int | None = None, split_tile: int = SPLIT_TILE) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence) over its paged context (see the module
    doc) into out [B, Hq, D] of q's dtype (unit stride along D; new when None); a sequence of
    length 0 writes nothing. num_splits: splits per (sequence, kv head) (default_splits when None);
    block_n: tokens per tile, min_chunk: tokens per split at least (powers of two >= 16),
    num_warps: the kernel's (NUM_WARPS for a 16-bit q, twice that for fp32, when None), split_tile:
    the splits whose partials the combine reads at once (a power of two <= MAX_SPLITS). Raises
    ValueError for what unsupported names. One launch, no host sync."""
    why = unsupported(q, key_cache, value_cache, block_table, seq_lens)
    if why is None and out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1
                                            or out.device != q.device):
        why = f"out {tuple(out.shape)} {out.dtype} must be q's shape {tuple(q.shape)} and dtype, unit stride along D"
    if why is None and num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        why = f"num_splits {num_splits} must be in 1..{MAX_SPLITS}"
    if why is None and not all(v >= 16 and v & (v - 1) == 0 for v in (block_n, min_chunk)):
        why = f"block_n {block_n} and min_chunk {min_chunk} must be powers of two >= 16"
    if why is None and not (1 <= split_tile <= MAX_SPLITS and split_tile & (split_tile - 1) == 0):
        why = f"split_tile {split_tile} must be a power of two in 1..{MAX_SPLITS}"
    if why is not None:
        raise ValueError(f"decode_attention: {why}")
    out = torch.empty_like(q) if out is None else out
    B, Hq, D = q.shape
    Hkv = key_cache.shape[2]
    if B == 0:
        return out
    S = num_splits or default_splits(B, Hkv, q.device)
    G = Hq // Hkv
    block_g, block_d = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    parts = torch.empty((B, Hkv, S, block_g, block_d) if S > 1 else (1,), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, Hkv, S, block_g, 2) if S > 1 else (1,), dtype=torch.float32, device=q.device)
    launch(decode_attention_kernel, (B, Hkv, S),
           q, key_cache, value_cache, block_table, seq_lens, out, parts, ml, _counters(B * Hkv, q.device),
           q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0), *key_cache.stride()[:3],
           S, key_cache.shape[1], float(scale) * math.log2(math.e),
           G=G, D=D, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, MIN_CHUNK=min_chunk,
           IEEE=q.dtype == torch.float32, MAX_S=MAX_SPLITS, SPLIT_TILE=split_tile,
           num_warps=num_warps or NUM_WARPS * max(1, q.element_size() // 2))
    return out
