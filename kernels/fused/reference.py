"""The unfused compositions the fused kernels replace, in torch, with vLLM's semantics: what the
custom ops (moe_serve.kernels.fused.ops) compute on devices our kernels do not run on (the CPU engine).

- add_rms_norm: vllm.ir.ops.layernorm's fused_add_rms_norm / rms_norm (RMSNorm.forward_native).
- qk_norm_rope: Qwen3's per-head q_norm / k_norm (those ops on [.., heads, D]), then
  RotaryEmbedding.forward_static (vllm.model_executor.layers.rotary_embedding.base): the rotary
  part in the activation dtype, the cos/sin cache cast to it, neox or GPT-J pairs, the part past
  rot_dim passed through.
- write_kv_cache: reshape_and_cache_flash's copy into the paged cache (kv_cache_dtype "auto").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] normalised over its last dim, times weight [K], in x's dtype."""
    orig = x.dtype
    s = x.to(torch.float32)
    s = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (s.to(weight.dtype) * weight).to(orig)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, residual_out) [M, K]: without a residual, (rms_norm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    orig = x.dtype
    s = x.to(torch.float32) + residual.to(torch.float32)
    res_out = s.to(orig)
    s = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (s.to(weight.dtype) * weight).to(orig), res_out


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y = F.linear(h, weight, bias), residual_out, h) of add_rms_norm."""
    h, res_out = add_rms_norm(x, residual, norm_w, eps)
    return F.linear(h, weight, bias), res_out, h


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, H, rot] rotated by cos, sin [T, rot / 2] (x's dtype), neox halves or GPT-J pairs."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                 eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, rot_dim: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, Hq * D], k [T, Hkv * D]) of qkv [T, (Hq + 2 Hkv) * D]: each head RMS-normalised
    with its weight [D], then its first rot_dim columns rotated at positions [T] with
    cos_sin_cache [max_pos, rot_dim] (cos | sin halves). qkv is left as it is."""
    T = qkv.shape[0]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = rms_norm(q.reshape(T, num_q_heads, head_dim), q_norm_w, eps)
    k = rms_norm(k.reshape(T, num_kv_heads, head_dim), k_norm_w, eps)
    cos, sin = cos_sin_cache.to(qkv.dtype).index_select(0, positions.flatten()).chunk(2, dim=-1)
    q = torch.cat((rope(q[..., :rot_dim], cos, sin, neox), q[..., rot_dim:]), dim=-1)
    k = torch.cat((rope(k[..., :rot_dim], cos, sin, neox), k[..., rot_dim:]), dim=-1)
    return q.reshape(T, q_size), k.reshape(T, kv_size)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] into key_cache, value_cache [num_blocks, block_size, Hkv, D] at
    slot_mapping [T] (slot = block * block_size + offset; slots < 0 skipped)."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offs = slots // block_size, slots % block_size
    key_cache[blocks, offs] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offs] = value[keep].to(value_cache.dtype)
