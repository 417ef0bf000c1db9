"""moe-serve kernels: Triton fused MoE (swap-AB, FP8 W8A8) for Hopper.

Three subpackages: ``moe_serve.kernels.moe`` (the Triton kernels, their launcher, configs and routing),
``moe_serve.kernels.plugin`` (the vLLM plugin) and ``moe_serve.kernels.tuning`` (``moe-serve tune``).
Kept light on purpose: importing ``kernels`` imports neither torch nor triton.
Public entry points::

    from moe_serve.kernels.moe.fused_moe import fused_moe, Fp8Scales
    from moe_serve.kernels.moe.moe_variants import warm_moe_variants
    from moe_serve.kernels.plugin import jit_monitor

The modules and their layers: docs/architecture.md.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["fused_moe", "Fp8Scales", "warm_moe_variants", "jit_monitor"]

_LAZY = {
    "fused_moe": ("moe_serve.kernels.moe.fused_moe", "fused_moe"),
    "Fp8Scales": ("moe_serve.kernels.moe.fused_moe", "Fp8Scales"),
    "warm_moe_variants": ("moe_serve.kernels.moe.moe_variants", "warm_moe_variants"),
}


def __getattr__(name: str) -> Any:
    """Lazy attribute access (PEP 562) so heavy modules load on first use."""
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in ("jit_monitor",):
        return importlib.import_module(f"moe_serve.kernels.plugin.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
