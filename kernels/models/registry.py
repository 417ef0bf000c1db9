"""Which vLLM architectures moe-serve's model classes serve, and their registration with vLLM's
ModelRegistry (the supported way to add or replace a model class).

`register_model_classes(fused, router)` replaces every architecture's class by ours where the
worker's HookPlan runs the fused decode-step pieces (`fused`), and the GATED architectures' where
it installs the router hook (`router`: our Mixtral class moves each MoE block's gate into its
runner, kernels/models/runner_gate.py); vLLM's classes serve otherwise. Call it in every process
that builds the model, before the model is built (the plugin's worker init, once the config is
known); vLLM imports the class by name only then.
"""
from __future__ import annotations

MODEL_CLASSES = {  # architecture -> "module:class" of ours
    "Qwen3MoeForCausalLM": "moe_serve.kernels.models.qwen3_moe:FusedQwen3MoeForCausalLM",
    "MixtralForCausalLM": "moe_serve.kernels.models.mixtral:FusedMixtralForCausalLM",
}
GATED = ("MixtralForCausalLM",)   # architectures whose MoE blocks compute their gate in the model


def architectures(fused: bool, router: bool) -> list[str]:
    """The architectures whose class ours replaces: all with the fused pieces, the GATED ones
    with our router."""
    return [arch for arch in MODEL_CLASSES if fused or (router and arch in GATED)]


def register_model_classes(fused: bool, router: bool = False) -> list[str]:
    """Register our model classes with vLLM for `architectures(fused, router)`; those architectures."""
    archs = architectures(fused, router)
    if archs:
        from vllm import ModelRegistry

        for arch in archs:
            ModelRegistry.register_model(arch, MODEL_CLASSES[arch])
    return archs
