"""The dense GEMMs of a decode step (QKV, O, MLP projections, lm_head) at 1..8 tokens: a split-K
GEMV on CUDA cores that reads each weight element once for all tokens (gemv.py), its configs
(configs.py), and the torch custom op vLLM's unquantized layers go through (op.py; installed by
kernels/plugin/dense_hook.py). Imports nothing from moe_serve.kernels.plugin or moe_serve.kernels.tuning.
"""
