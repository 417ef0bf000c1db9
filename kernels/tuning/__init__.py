"""The tuner behind ``moe-serve tune``: reads a model's per-rank MoE shapes, compiles candidate
configs ahead of time, times them (and vLLM's kernel) by CUDA-graph replay, and writes the
per-shape config tables and the routing table (make_routing: hysteresis over the measured
ratios) that moe_serve.kernels.moe reads; and ``moe-serve explain``, which prints what those tables make
moe_serve.kernels.moe.selection choose. Runs offline or before serving, never inside a request.
"""
