"""vLLM's kernel-side pieces our kernels reuse, when vLLM is importable: its fused_moe config
for a shape, its CUDA alignment op and its fused_experts (the baseline the tuner and the
benchmarks time). Each returns None without vLLM; kernels.plugin.vllm_compat does the touching."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

import torch


@functools.lru_cache(maxsize=None)
def _compat() -> ModuleType | None:
    try:
        from kernels.plugin import vllm_compat  # optional heavy dependency: imports vllm
    except ImportError:
        return None
    return vllm_compat


def moe_config(M: int, E: int, N: int, K: int, topk: int, dtype: str) -> dict[str, Any] | None:
    compat = _compat()
    return compat.moe_config(M, E, N, K, topk, dtype) if compat else None


@functools.lru_cache(maxsize=None)
def align_op() -> Callable | None:
    compat = _compat()
    return compat.align_op() if compat and torch.cuda.is_available() else None


@functools.lru_cache(maxsize=None)
def fused_experts() -> tuple[Callable, Callable] | None:
    compat = _compat()
    return compat.fused_experts() if compat else None
