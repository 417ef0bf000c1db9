"""What the fused model classes share: the input norm + QKV piece of a decoder layer (plan and
forward), and turning a built vLLM model's decoder layers into the fused subclasses.

A layer runs the piece where `norm_gemv_fits`: the switch is on, no LoRA, the batch need not be
invariant (vLLM's VLLM_BATCH_INVARIANT: our kernels reduce in their own order), the QKV projection is
vLLM's unquantized QKVParallelLinear (its bias added, not returned), and the input norm is vLLM's
plain RMSNorm. Then `attention_block` computes the residual add + norm + QKV GEMV as one op
(moe_serve.kernels.fused.ops.fused_norm_linear) and hands qkv to the attention's `attend`; else it runs
vLLM's code (the norm, then the attention module on the normalised states).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from vllm import envs
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear

from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.fused.ops import fused_norm_linear

UNQUANTIZED = "UnquantizedLinearMethod"


def plain_norm(norm: Any) -> bool:
    """vLLM's RMSNorm with a weight over the whole row (what the fused ops compute)."""
    return type(norm) is RMSNorm and norm.has_weight and norm.variance_size_override is None


def norm_gemv_fits(layer: Any, config: PluginConfig, lora: bool) -> bool:
    """Whether this decoder layer runs the input norm + QKV piece (see the module doc)."""
    qkv = layer.self_attn.qkv_proj
    return bool(config.fuse_norm_gemv and not lora and not envs.VLLM_BATCH_INVARIANT
                and type(qkv) is QKVParallelLinear
                and type(qkv.quant_method).__name__ == UNQUANTIZED and not qkv.skip_bias_add
                and plain_norm(layer.input_layernorm))


def attention_block(layer: Any, positions: torch.Tensor, hidden_states: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, residual) of a decoder layer's first half: the input norm (with the
    residual add, none in the first layer), QKV, attention, o_proj."""
    attn = layer.self_attn
    if layer.fuse_norm_gemv:
        norm, qkv_proj = layer.input_layernorm, attn.qkv_proj
        qkv, residual, _ = fused_norm_linear(hidden_states, residual, norm.weight, norm.variance_epsilon,
                                             qkv_proj.weight, qkv_proj.bias)
        return attn.attend(positions, qkv), residual
    if residual is None:                              # vLLM's decoder layer
        residual = hidden_states
        hidden_states = layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    return attn(positions=positions, hidden_states=hidden_states), residual


def fuse_layers(layers: Any, base: type, layer_cls: type, attn_cls: type, config: PluginConfig, lora: bool,
                attn_plan: Callable[[Any, PluginConfig], dict[str, bool]] | None = None) -> None:
    """Make each built decoder layer of vLLM's class `base` (not a pipeline stage's placeholder)
    a `layer_cls` with a `attn_cls` attention (subclasses: only their forward differs), with its
    plan: `fuse_norm_gemv`, and the attention's flags from attn_plan. A QKV projection the fused
    op reads keeps its weight on vLLM's CPU engine (vLLM's own `_cpu_skip_gemm_dispatch`)."""
    for layer in layers:
        if not isinstance(layer, base):
            continue
        norm_gemv = norm_gemv_fits(layer, config, lora)
        flags = attn_plan(layer, config) if attn_plan is not None else {}
        layer.__class__ = layer_cls
        layer.self_attn.__class__ = attn_cls
        layer.fuse_norm_gemv = norm_gemv
        for name, value in flags.items():
            setattr(layer.self_attn, name, value)
        if norm_gemv:
            layer.self_attn.qkv_proj._cpu_skip_gemm_dispatch = True


def fused_layer_counts(layers: Any, layer_cls: type, attn_flags: tuple[str, ...] = ()) -> dict[str, int]:
    """How many decoder layers run each fused piece."""
    fused = [m for m in layers if isinstance(m, layer_cls)]
    counts = {"fuse_norm_gemv": sum(m.fuse_norm_gemv for m in fused)}
    counts.update({flag: sum(getattr(m.self_attn, flag) for m in fused) for flag in attn_flags})
    return counts
