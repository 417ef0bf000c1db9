"""Named MoE shard shapes (E experts, N per-rank intermediate, K hidden, top-k): the shapes the
kernel benchmarks time and their results name, so the routing table can be built from them."""
from __future__ import annotations

TUNED = {  # shapes with a shipped H200 table (kernels/moe/configs): TP=8 shards, TP=2, one GPU
    "Mixtral-8x7B/TP8": (8, 1792, 4096, 2),
    "Qwen3-30B-A3B/TP8": (128, 96, 2048, 8),
    "DeepSeek-V3/TP8": (256, 256, 7168, 8),
    "Mixtral-8x7B/TP2": (8, 7168, 4096, 2),
    "Qwen3-30B-A3B/TP1": (128, 768, 2048, 8),
}
UNTUNED = {  # whole models, TP2/TP4 deployments, odd N and K (gpt-oss, Phi, Qwen1.5)
    "Mixtral-8x22B/TP8": (8, 2048, 6144, 2),
    "Qwen3-235B-A22B/TP8": (128, 192, 4096, 8),
    "DeepSeek-V2-Lite": (64, 1408, 2048, 6),
    "OLMoE": (64, 1024, 2048, 8),
    "gpt-oss-20b-shape/TP2": (32, 1440, 2880, 4),
    "Phi-3.5-MoE/TP8": (16, 800, 4096, 2),
    "Qwen1.5-MoE-A2.7B/TP4": (60, 352, 2048, 4),
}
