"""Which vLLM architectures moe-serve's model classes serve, and their registration with vLLM's
ModelRegistry (the supported way to add or replace a model class).

`register_model_classes(config)` replaces each architecture's class by ours when a fused switch
is on in optimized mode (nothing otherwise: vLLM's classes serve). Call it in every process that
builds the model, before the model is built (the plugin's worker init, once the config is
known); vLLM imports the class by name only then.
"""
from __future__ import annotations

from kernels.config import PluginConfig

MODEL_CLASSES = {  # architecture -> "module:class" of ours
    "Qwen3MoeForCausalLM": "kernels.models.qwen3_moe:FusedQwen3MoeForCausalLM",
    "MixtralForCausalLM": "kernels.models.mixtral:FusedMixtralForCausalLM",
}


def wanted(config: PluginConfig) -> bool:
    """Whether the config asks for a fused piece our model classes run."""
    return config.mode == "optimized" and (config.fuse_norm_gemv or config.fuse_qk_norm_rope)


def register_model_classes(config: PluginConfig) -> list[str]:
    """Register our model classes with vLLM where `wanted`; the architectures registered."""
    if not wanted(config):
        return []
    from vllm import ModelRegistry

    for arch, target in MODEL_CLASSES.items():
        ModelRegistry.register_model(arch, target)
    return list(MODEL_CLASSES)
