"""The tuner behind ``moe-serve tune``: reads a model's per-rank MoE shapes, compiles candidate
configs ahead of time, times them (and vLLM's kernel) by CUDA-graph replay, and writes the
per-shape config tables and the routing table that kernels.moe reads. Runs offline or before
serving, never inside a request.
"""
