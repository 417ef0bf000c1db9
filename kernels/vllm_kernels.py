"""vLLM's own MoE pieces that our kernels reuse on the GPU: its tuned (or default) fused_moe
config for a shape, its CUDA token-alignment op, and its fused_experts (the baseline the
tuner and the benchmarks time). Each returns None when vLLM (or its CUDA ops) is absent.
Same call signatures in vLLM 0.26 and 0.32 (read from both sources)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_FUSED_MOE = "vllm.model_executor.layers.fused_moe.fused_moe"


@functools.lru_cache(maxsize=None)
def _module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - vLLM absent or built for another device
        return None


def moe_config(M: int, E: int, N: int, K: int, topk: int, dtype: str) -> dict[str, Any] | None:
    """vLLM's fused_moe config for M tokens of (E, N per rank, K) in bf16 or fp8 W8A8:
    its shipped table for this GPU where one exists, else its default."""
    mod = _module(_FUSED_MOE)
    if mod is None:
        return None
    try:
        return dict(mod.try_get_optimal_moe_config((E, 2 * N, K), (E, K, N), topk,
                                                   "fp8_w8a8" if dtype == "fp8" else None, M))
    except Exception:  # noqa: BLE001
        return None


def align_op() -> Callable | None:
    """vLLM's moe_align_block_size(topk_ids, block_size, num_experts) -> (sorted_ids,
    expert_ids, num_tokens_post_pad), a CUDA kernel; None without vLLM's CUDA ops."""
    mod = _module("vllm.model_executor.layers.fused_moe.moe_align_block_size")
    if mod is None or not torch.cuda.is_available():
        return None
    return getattr(mod, "moe_align_block_size", None)


def fused_experts() -> tuple[Callable, Callable] | None:
    """(fused_experts, fp8_w8a8_moe_quant_config) from vLLM, or None."""
    mod = _module(_FUSED_MOE)
    cfg = _module("vllm.model_executor.layers.fused_moe.config")
    if mod is None or cfg is None:
        return None
    return mod.fused_experts, cfg.fp8_w8a8_moe_quant_config
