"""Mixtral as moe-serve serves it: vLLM's MixtralForCausalLM with, under the fused_router setting,
each MoE block's gate moved into its runner (moe_serve.kernels.models.runner_gate: our router serves it), and
with the fused input norm + QKV piece (fuse_norm_gemv) decoder layers that compute the residual
add + RMSNorm + QKV projection as one op (moe_serve.kernels.models.common), the rest vLLM's (as
moe_serve.kernels.models.qwen3_moe describes for Qwen3-MoE). Mixtral has no Q/K norm, so fuse_qk_norm_rope
does not apply. vLLM 0.26 and 0.32 build these modules alike.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.mixtral import MixtralAttention, MixtralDecoderLayer, MixtralForCausalLM

from moe_serve.kernels.config import current
from moe_serve.kernels.models.common import attention_block, fuse_layers, fused_layer_counts
from moe_serve.kernels.models.runner_gate import move_gate


class FusedMixtralAttention(MixtralAttention):
    """vLLM's attention block; `attend` takes the QKV projection's output."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        return self.attend(positions, qkv)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The block's output [T, hidden] from qkv [T, (Hq + 2 Hkv) * D] (vLLM's MixtralAttention.forward)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(attn_output)
        return output


class FusedMixtralDecoderLayer(MixtralDecoderLayer):
    """vLLM's decoder layer; with fuse_norm_gemv its input norm and QKV projection are one op."""

    fuse_norm_gemv = False

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = attention_block(self, positions, hidden_states, residual)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.block_sparse_moe(hidden_states)
        return hidden_states, residual


class FusedMixtralForCausalLM(MixtralForCausalLM):
    """vLLM's MixtralForCausalLM, its decoder layers the fused subclasses, its MoE blocks' gates in
    their runners under fused_router."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = current()
        if config.fuse_norm_gemv:         # else vLLM's decoder layers stay as built
            fuse_layers(self.model.layers, MixtralDecoderLayer, FusedMixtralDecoderLayer, FusedMixtralAttention,
                        config, getattr(vllm_config, "lora_config", None) is not None)
        if config.fused_router:
            for layer in self.model.layers:
                if isinstance(layer, MixtralDecoderLayer):
                    move_gate(layer.block_sparse_moe)

    def fused_layers(self) -> dict[str, int]:
        """How many decoder layers run each fused piece."""
        return fused_layer_counts(self.model.layers, FusedMixtralDecoderLayer)
