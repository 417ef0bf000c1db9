"""The yardstick: moe-serve against `vllm serve` on a whole model over HTTP, alternating fresh
server processes (yardstick.py runs it; servers, load, stats, render, profile its parts)."""
