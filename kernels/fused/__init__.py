"""Fused pieces of a decode step's layer at 1..16 tokens, each behind its own PluginConfig switch:
residual add + RMSNorm in the prologue of the next GEMV (norm_gemv.py), Q/K RMSNorm + RoPE
(+ the paged KV-cache write) in one launch (qk_norm_rope.py), their vLLM-semantics torch
compositions (reference.py), the torch custom ops the model classes call (ops.py), and the
kernel-level benchmark cases (bench_cases.py). Imports moe_serve.kernels.dense and moe_serve.kernels.moe, nothing
from moe_serve.kernels.models, moe_serve.kernels.plugin or moe_serve.kernels.tuning; vLLM only for bench_cases' baselines.
"""
