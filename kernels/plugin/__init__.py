"""The vLLM plugin (entry point ``vllm.general_plugins: moe_serve_kernels``): loaded by vLLM in
every process, it hooks ``TritonExperts.apply`` in each worker to run moe_serve.kernels.moe where the
routing table says ours is faster, warms every layer shape's kernels before serving, counts
Triton compiles, and writes the worker's metrics for the API process. vllm_compat is where it
touches vLLM's internals; backend_policy picks vLLM's MoE backend in the API process.
"""
