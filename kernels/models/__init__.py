"""Out-of-tree model classes (vLLM's ModelRegistry extension point) that run the fused decode
pieces of moe_serve.kernels.fused behind their PluginConfig switches: subclasses of vLLM's own classes whose
layers call the fused custom ops where vLLM's layer calls its norm, projection and rotary ops.
Imports moe_serve.kernels.fused, moe_serve.kernels.config and vLLM; nothing from moe_serve.kernels.plugin or moe_serve.kernels.tuning.
"""
