"""moe-serve kernels: Triton fused MoE (swap-AB, FP8 W8A8) for Hopper.

Three subpackages: ``kernels.moe`` (the Triton kernels, their launcher, configs and routing),
``kernels.plugin`` (the vLLM plugin) and ``kernels.tuning`` (``moe-serve tune``).
Kept light on purpose: importing ``kernels`` imports neither torch nor triton.
Public entry points::

    from kernels.moe.fused_moe import fused_moe, Fp8Scales
    from kernels.moe.moe_variants import warm_moe_variants
    from kernels.plugin import jit_monitor

The modules and their layers: docs/architecture.md.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["fused_moe", "Fp8Scales", "warm_moe_variants", "jit_monitor"]

_LAZY = {
    "fused_moe": ("kernels.moe.fused_moe", "fused_moe"),
    "Fp8Scales": ("kernels.moe.fused_moe", "Fp8Scales"),
    "warm_moe_variants": ("kernels.moe.moe_variants", "warm_moe_variants"),
}


def __getattr__(name: str) -> Any:
    """Lazy attribute access (PEP 562) so heavy modules load on first use."""
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in ("jit_monitor",):
        return importlib.import_module(f"kernels.plugin.{name}")
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
