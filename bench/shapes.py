"""MoE shard shapes (E experts, N per-rank intermediate, K hidden, top-k) for the benchmarks."""
from __future__ import annotations

TUNED = {  # TP=8 shards from DESIGN.md
    "Mixtral-8x7B/TP8": (8, 1792, 4096, 2),
    "Qwen3-30B-A3B/TP8": (128, 96, 2048, 8),
    "DeepSeek-V3/TP8": (256, 256, 7168, 8),
}
UNTUNED = {
    "Mixtral-8x22B/TP8": (8, 2048, 6144, 2),
    "Qwen3-235B-A22B/TP8": (128, 192, 4096, 8),
    "DeepSeek-V2-Lite": (64, 1408, 2048, 6),
    "OLMoE": (64, 1024, 2048, 8),
}
SMOKE = {"tiny-a": (8, 32, 64, 2), "tiny-b": (16, 16, 32, 4)}
M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUICK_MS = (1, 4, 16, 64, 256)
