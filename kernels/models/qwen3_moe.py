"""Qwen3-MoE with the fused decode pieces: vLLM's Qwen3MoeForCausalLM whose decoder layers call
moe_serve.kernels.fused's custom ops, each behind its PluginConfig switch (moe_serve.kernels.config.current() when
the model is built):

- fuse_norm_gemv: the input norm (residual add + RMSNorm) and the QKV projection as one op,
  ``moe_serve.fused_norm_linear`` (moe_serve.kernels.models.common);
- fuse_qk_norm_rope: q_norm, k_norm and the rotary embedding as one op,
  ``moe_serve.fused_qk_norm_rope`` (in place of the per-head norms and ``rotary_emb``).

Everything else (attention, o_proj, the post-attention norm, the MoE block, weight loading,
the interfaces vLLM reads) is vLLM's: the class is vLLM's, and its layers become the subclasses
below once built (their forward only differs), so `isinstance` checks, the checkpoint's names
and vLLM's torch.compile of the model stay as they are. A layer keeps vLLM's code for a piece
its modules do not fit (common.norm_gemv_fits; `qk_fits`: a rotary embedding of another kind,
q / k norms other than vLLM's plain RMSNorm or with different epsilons). vLLM 0.26 and 0.32
build these modules alike.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.qwen3_moe import (Qwen3MoeAttention, Qwen3MoeDecoderLayer,
                                                  Qwen3MoeForCausalLM)

from moe_serve.kernels.config import PluginConfig, current
from moe_serve.kernels.fused.ops import fused_qk_norm_rope
from moe_serve.kernels.models.common import attention_block, fuse_layers, fused_layer_counts, plain_norm


def qk_fits(layer: Qwen3MoeDecoderLayer, config: PluginConfig) -> dict[str, bool]:
    """{"fuse_qk_norm_rope": whether this layer runs the Q/K norm + RoPE piece}."""
    attn = layer.self_attn
    rope = attn.rotary_emb
    fits = (config.fuse_qk_norm_rope and isinstance(rope, RotaryEmbedding)
            and type(rope).forward_native is RotaryEmbedding.forward_native
            and type(rope).forward_cuda is RotaryEmbedding.forward_cuda
            and plain_norm(attn.q_norm) and plain_norm(attn.k_norm)
            and attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon)
    return {"fuse_qk_norm_rope": bool(fits)}


class FusedQwen3MoeAttention(Qwen3MoeAttention):
    """vLLM's attention block; `attend` takes the QKV projection's output, so the layer can
    produce it fused with its input norm."""

    fuse_qk_norm_rope = False

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        return self.attend(positions, qkv)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The block's output [T, hidden] from qkv [T, (Hq + 2 Hkv) * D]."""
        if self.fuse_qk_norm_rope:
            rope = self.rotary_emb
            q, k = fused_qk_norm_rope(qkv, positions, self.q_norm.weight, self.k_norm.weight,
                                      self.q_norm.variance_epsilon, rope.cos_sin_cache, self.num_heads,
                                      self.num_kv_heads, self.head_dim, rope.rotary_dim, rope.is_neox_style)
            v = qkv[..., self.q_size + self.kv_size:]
        else:                                         # vLLM's Qwen3MoeAttention.forward
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q_by_head = self.q_norm(q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim))
            q = q_by_head.view(q.shape)
            k_by_head = self.k_norm(k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim))
            k = k_by_head.view(k.shape)
            q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(attn_output)
        return output


class FusedQwen3MoeDecoderLayer(Qwen3MoeDecoderLayer):
    """vLLM's decoder layer; with fuse_norm_gemv its input norm and QKV projection are one op."""

    fuse_norm_gemv = False

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = attention_block(self, positions, hidden_states, residual)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class FusedQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """vLLM's Qwen3MoeForCausalLM, its decoder layers the fused subclasses (see the module doc)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        fuse_layers(self.model.layers, Qwen3MoeDecoderLayer, FusedQwen3MoeDecoderLayer, FusedQwen3MoeAttention,
                    current(), getattr(vllm_config, "lora_config", None) is not None, qk_fits)

    def fused_layers(self) -> dict[str, int]:
        """How many decoder layers run each fused piece."""
        return fused_layer_counts(self.model.layers, FusedQwen3MoeDecoderLayer, ("fuse_qk_norm_rope",))
