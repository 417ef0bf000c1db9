"""Per-process state of the vLLM plugin: mode, worker report, hooks installed, MoE shapes seen.

One of these per vLLM process (API, engine core, each worker); the hook modules
(plugin_jit, plugin_moe_hook, plugin_warmup) and kernels.vllm_plugin share it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from kernels.jit_export import WorkerReport

logger = logging.getLogger("vllm.moe_serve_plugin")  # under "vllm": uses vLLM's handlers in workers

MODE_ENV = "MOE_SERVE_MOE_KERNELS"
MODES = ("optimized", "vllm")


@dataclass
class SchedulerLimits:
    """From the worker's scheduler config: the largest M a MoE layer sees (prefill, decode)."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None


limits = SchedulerLimits()
hooks: list[str] = []                              # what register() installed, for the report
pending_shapes: dict[tuple, dict[str, Any]] = {}   # MoE layer shapes seen, not yet warmed
warmed_shapes: set[tuple] = set()
vllm_ctx: dict[tuple, dict[str, Any]] = {}         # shape key -> what a vLLM warm-up call needs
vllm_warmed: set[tuple] = set()
logged_errors: set[str] = set()                    # error kinds already logged once
_report: WorkerReport | None = None


def mode() -> str:
    """'optimized' (default) or 'vllm', from MOE_SERVE_MOE_KERNELS."""
    value = os.environ.get(MODE_ENV, "optimized").strip().lower() or "optimized"
    if value not in MODES:
        logger.warning("%s=%r is not one of %s; using 'optimized'", MODE_ENV, value, MODES)
        return "optimized"
    return value


def report() -> WorkerReport:
    """This process's report (written to the runtime dir once the worker knows its rank)."""
    global _report
    if _report is None:
        _report = WorkerReport(None, plugin_loaded=True, mode=mode(), hooks=hooks, phase="warmup",
                               jit_monitor=False)
    return _report


def log_once(kind: str, message: str, *args: Any) -> None:
    """logger.error the first time an error of this kind happens in this process."""
    if kind not in logged_errors:
        logged_errors.add(kind)
        logger.error(message, *args)


def route_dtype(fp8: Any, dtype: Any) -> str:
    """Routing/config dtype key: 'fp8' for W8A8 layers, else the activation dtype's."""
    from kernels.fused_moe import dtype_name

    return "fp8" if fp8 else dtype_name(dtype)
