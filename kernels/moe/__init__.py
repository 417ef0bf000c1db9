"""The fused MoE itself: Triton kernels (token alignment, the aligned path's grouped GEMM,
the decode path's two kernels), the launcher that runs or records their launches, and what
picks a kernel config for a layer shape and M (tuned tables in ``configs/``, defaults,
shared-memory fit) and whether ours or vLLM's kernel serves it (the routing table), decided in
one place, selection.py. Imports nothing from moe_serve.kernels.plugin or moe_serve.kernels.tuning; vLLM only
through vllm_kernels, when present.
"""
