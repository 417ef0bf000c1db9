"""MoE shard shapes (E experts, N per-rank intermediate, K hidden, top-k) for the benchmarks:
the named ones (moe_serve.kernels.tuning.named_shapes, which the routing table is built from) and the
benchmarks' own smoke shapes and M lists."""
from __future__ import annotations

from moe_serve.kernels.tuning.named_shapes import TUNED, UNTUNED

__all__ = ["TUNED", "UNTUNED", "SMOKE", "M_LIST", "QUICK_MS"]

SMOKE = {"tiny-a": (8, 32, 64, 2), "tiny-b": (16, 16, 32, 4)}
M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUICK_MS = (1, 4, 16, 64, 256)
