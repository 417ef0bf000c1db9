"""The expert-kernel bench: our fused MoE against vLLM's `fused_experts` and the streaming floor
per shape, format and M (run.py runs it)."""
