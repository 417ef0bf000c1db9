"""Out-of-tree model classes (vLLM's ModelRegistry extension point) that run the fused decode
pieces of kernels.fused behind their PluginConfig switches: subclasses of vLLM's own classes whose
layers call the fused custom ops where vLLM's layer calls its norm, projection and rotary ops.
Imports kernels.fused, kernels.config and vLLM; nothing from kernels.plugin or kernels.tuning.
"""
