"""moe-serve: an OpenAI-compatible server for MoE models on vLLM."""

__version__ = "0.1.0"
