"""Fused pieces of a decode step's layer at 1..16 tokens, each behind its own PluginConfig switch:
residual add + RMSNorm in the prologue of the next GEMV (norm_gemv.py), Q/K RMSNorm + RoPE
(+ the paged KV-cache write) in one launch (qk_norm_rope.py), their vLLM-semantics torch
compositions (reference.py), the torch custom ops the model classes call (ops.py), and the
kernel-level benchmark cases (bench_cases.py). Imports kernels.dense and kernels.moe, nothing
from kernels.models, kernels.plugin or kernels.tuning; vLLM only for bench_cases' baselines.
"""
