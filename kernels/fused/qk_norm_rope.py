"""Q/K per-head RMSNorm + rotary embedding in place on the QKV projection's output, and
optionally K and V into vLLM's paged KV cache, in one launch.

For qkv [T, (Hq + 2 Hkv) * D] (q heads, then k heads, then v heads, D columns each):

    h    = rnd(rnd(x * rstd) * w)         per q / k head x [D]; w: q_norm / k_norm weight [D];
                                           rstd = 1 / sqrt(mean(x^2) + eps) in fp32
    out  = rope(h[:rot_dim]) | h[rot_dim:]  at the token's position (partial rotary: the columns
                                           past rot_dim pass through)

rope is vLLM's RotaryEmbedding: cos, sin = cos_sin_cache[pos] (the [max_pos, rot_dim] cache,
cos | sin halves, cast to the activation dtype as vLLM casts it), pairs (x1, x2) of the first
and second half of the rotary columns (neox) or of even and odd columns (GPT-J), o1 = x1 cos -
x2 sin, o2 = x2 cos + x1 sin. rnd rounds to the activation dtype; the norm rounds as vLLM's
rms_norm (moe_serve.kernels.fused.reference) and the normalised head is rounded before the rotation, as
vLLM stores it between its two ops; the rotation itself is fp32 with one rounding (vLLM's native
path rounds after each product in bf16 / fp16: within an ulp of this).

With a cache, K (normalised and rotated) and V also go to key_cache / value_cache [num_blocks,
block_size, Hkv, D] (any strides but unit along D; the cache's dtype is the activations': no FP8
cache) at slot_mapping[t] = block * block_size + offset, tokens with a negative slot skipped:
vLLM's reshape_and_cache_flash for kv_cache_dtype "auto".

qk_norm_rope_kernel   grid (T, Hq + Hkv)
    Program (t, head) holds one head: loads it, its norm weight and (the rotary columns) its
    partner columns (the other half, or the neighbour) from L1, computes the norm's rstd over the
    whole head, rotates, stores in place; a k head's program also writes that head's K and V
    into the cache. No limit on T: the same kernel serves prefill.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.fused.norm_gemv import TL_DTYPES
from moe_serve.kernels.moe.launch import jit, launch

KVCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # key_cache, value_cache, slot_mapping


@triton.jit
def _normed(ptrs, w_ptrs, mask, rstd, DT: tl.constexpr):
    """rnd(rnd(x * rstd) * w) in fp32 for the head's columns at ptrs (weights at w_ptrs)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    return ((x * rstd).to(DT).to(tl.float32) * w).to(DT).to(tl.float32)


@jit()
def qk_norm_rope_kernel(
    # pointers: qkv [T, (Hq + 2 Hkv) * D], the output qk [T, (Hq + Hkv) * D] (qkv itself: in
    # place), positions [T], the norm weights [D], cos_sin_cache [max_pos, ROT]; with
    # WRITE_CACHE key / value cache [blocks, block_size, Hkv, D] and slot_mapping [T]
    qkv_ptr, out_ptr, pos_ptr, qw_ptr, kw_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
    # strides (elements): qkv's row, the output's row, the cache's row; the caches' block, slot
    # and head
    stride_t, stride_o, stride_cs, stride_cb, stride_cs_slot, stride_ch,
    # sizes, the norm's epsilon
    block_size, eps,
    # meta
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr,
    WRITE_CACHE: tl.constexpr, DT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    is_k = head >= HQ
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    base = qkv_ptr + t.to(tl.int64) * stride_t + head * D              # q heads, then k heads
    w_ptr = tl.where(is_k, kw_ptr, qw_ptr)
    x = tl.load(base + d, mask=in_d, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    h = ((x * rstd).to(DT).to(tl.float32) * tl.load(w_ptr + d, mask=in_d, other=0.0).to(tl.float32))
    h = h.to(DT).to(tl.float32)
    if NEOX:                                   # x1: the rotary columns' first half, x2: the second
        first = d < HALF
        f = tl.where(first, d, d - HALF)                               # the frequency of column d
        partner = tl.where(first, d + HALF, d - HALF)
    else:                                      # x1: even columns, x2: odd
        first = d % 2 == 0
        f = d // 2
        partner = d ^ 1
    rot = d < ROT
    hp = _normed(base + partner, w_ptr + partner, rot, rstd, DT)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + f, mask=rot, other=0.0).to(DT).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + f, mask=rot, other=0.0).to(DT).to(tl.float32)
    out = tl.where(rot, h * cos + tl.where(first, -hp, hp) * sin, h).to(DT)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + head * D + d, out, mask=in_d)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        j = head - HQ                                                   # the kv head
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs_slot + j * stride_ch + d
        write = d < tl.where(is_k & (slot >= 0), D, 0)
        tl.store(kc_ptr + dst, out, mask=write)
        v = tl.load(base + HKV * D + d, mask=write, other=0.0)         # the k head's v head
        tl.store(vc_ptr + dst, v, mask=write)


def unsupported(qkv: torch.Tensor, positions: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                rot_dim: int, kv_cache: KVCache | None) -> str | None:
    """None when qk_norm_rope takes the call as laid out, else why not (see qk_norm_rope)."""
    T = qkv.shape[0] if qkv.dim() == 2 else -1
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        return f"qkv {tuple(qkv.shape)} must be [T, (Hq + 2 Hkv) * D = {width}], unit stride along it"
    if qkv.dtype not in TL_DTYPES:
        return f"dtype: qkv {qkv.dtype} (one of bf16, fp16, fp32)"
    if tuple(positions.shape) != (T,) or positions.dtype not in (torch.int32, torch.int64) or (
            not positions.is_contiguous()):
        return f"positions {tuple(positions.shape)} {positions.dtype} must be a contiguous int32 / int64 [T={T}]"
    if any(tuple(w.shape) != (head_dim,) or w.dtype != qkv.dtype or not w.is_contiguous()
           for w in (q_norm_w, k_norm_w)):
        return f"norm weights must be contiguous [D={head_dim}] of qkv's dtype"
    if not (0 < rot_dim <= head_dim and rot_dim % 2 == 0):
        return f"rot_dim {rot_dim} must be even and in 2..D={head_dim}"
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rot_dim or cos_sin_cache.stride(1) != 1:
        return f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_pos, rot_dim={rot_dim}], unit stride"
    tensors = [qkv, positions, q_norm_w, k_norm_w, cos_sin_cache]
    if kv_cache is not None:
        key_cache, value_cache, slots = kv_cache
        shape = (key_cache.shape[0], key_cache.shape[1], num_kv_heads, head_dim) if key_cache.dim() == 4 else None
        if shape is None or tuple(key_cache.shape) != shape or tuple(value_cache.shape) != shape:
            return f"key / value cache {tuple(key_cache.shape)} must be [blocks, block_size, Hkv, D]"
        if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
            return "key / value cache: one layout, unit stride along D"
        if key_cache.dtype != qkv.dtype or value_cache.dtype != qkv.dtype:
            return f"cache dtype {key_cache.dtype}: the activations' ({qkv.dtype}), no quantized cache"
        if tuple(slots.shape) != (T,) or slots.dtype not in (torch.int32, torch.int64) or not slots.is_contiguous():
            return f"slot_mapping {tuple(slots.shape)} must be a contiguous int32 / int64 [T={T}]"
        tensors += [key_cache, value_cache, slots]
    if any(t.device != qkv.device for t in tensors):
        return "device: the tensors are on different devices"
    return None


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                 eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 rot_dim: int, neox: bool, kv_cache: KVCache | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The normalised and rotated q | k heads of qkv [T, (Hq + 2 Hkv) * D] (see the module doc):
    into out [T, (Hq + Hkv) * D] (unit stride along a row), or in place into qkv's first
    (Hq + Hkv) * D columns when out is None; returns what was written (qkv's view in place).
    kv_cache: (key_cache, value_cache, slot_mapping) to write K and V into. Raises ValueError for
    what unsupported names. One launch, no host sync: CUDA-graph capturable."""
    why = unsupported(qkv, positions, q_norm_w, k_norm_w, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                      rot_dim, kv_cache)
    T, width = qkv.shape[0], (num_q_heads + num_kv_heads) * head_dim
    if why is None and out is not None and (tuple(out.shape) != (T, width) or out.dtype != qkv.dtype
                                            or out.stride(1) != 1 or out.device != qkv.device):
        why = f"out {tuple(out.shape)} {out.dtype} must be [T={T}, (Hq + Hkv) * D={width}] of qkv's dtype"
    if why is not None:
        raise ValueError(f"qk_norm_rope: {why}")
    dst = qkv[:, :width] if out is None else out
    if T == 0:
        return dst
    kc, vc, slots = kv_cache if kv_cache is not None else (qkv, qkv, positions)
    block_d = triton.next_power_of_2(head_dim)
    launch(qk_norm_rope_kernel, (T, num_q_heads + num_kv_heads),
           qkv, dst, positions, q_norm_w, k_norm_w, cos_sin_cache, kc, vc, slots,
           qkv.stride(0), dst.stride(0), cos_sin_cache.stride(0),
           *(kc.stride()[:3] if kv_cache is not None else (0, 0, 0)),
           kc.shape[1] if kv_cache is not None else 1, float(eps),
           HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, ROT=rot_dim, NEOX=bool(neox),
           WRITE_CACHE=kv_cache is not None, DT=TL_DTYPES[qkv.dtype], BLOCK_D=block_d,
           num_warps=max(1, min(4, block_d // 64)))
    return dst
