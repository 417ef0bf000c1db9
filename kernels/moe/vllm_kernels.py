"""vLLM's kernel-side pieces our kernels reuse, when vLLM is importable: its fused_moe config
for a shape, its CUDA alignment op and its fused_experts (the baseline the tuner and the
benchmarks time). Each returns None without vLLM. The locations below are vLLM internals;
moe_serve.kernels.plugin.vllm_compat pins them (pin_kernel_baselines) on every supported vLLM version."""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

from moe_serve.kernels.moe import quant_format

_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
CONFIG_LOOKUP = (f"{_FUSED_MOE}.fused_moe", "try_get_optimal_moe_config")
ALIGN_OP = (f"{_FUSED_MOE}.moe_align_block_size", "moe_align_block_size")
FUSED_EXPERTS = (f"{_FUSED_MOE}.fused_moe", "fused_experts")
FP8_QUANT_CONFIG = (f"{_FUSED_MOE}.config", "fp8_w8a8_moe_quant_config")


@functools.lru_cache(maxsize=None)
def load(where: tuple[str, str]) -> Any | None:
    """The object `name` of vLLM module `mod` for where = (mod, name); None without vLLM."""
    try:
        return getattr(importlib.import_module(where[0]), where[1])
    except ImportError:  # optional heavy dependency
        return None


def vllm_dtype(fmt: str) -> tuple[str | None, list[int] | None]:
    """vLLM's (config dtype, block_shape) for a moe_serve.kernels.moe.quant_format key."""
    bs = quant_format.block_shape(fmt)
    return ("fp8_w8a8" if quant_format.is_fp8(fmt) else None), (list(bs) if bs else None)


def moe_config(M: int, E: int, N: int, K: int, topk: int, dtype: str) -> dict[str, Any] | None:
    """vLLM's fused_moe config for M tokens of (E, N per rank, K) and format `dtype` (a
    quant_format key): its shipped table for this GPU where one exists, else its default;
    None if it cannot choose."""
    lookup = load(CONFIG_LOOKUP)
    if lookup is None:
        return None
    vdt, block = vllm_dtype(dtype)
    try:
        return dict(lookup((E, 2 * N, K), (E, K, N), topk, vdt, M, block_shape=block))
    except Exception:  # noqa: BLE001 - no config machinery for this platform
        return None


@functools.lru_cache(maxsize=None)
def align_op() -> Callable | None:
    """vLLM's moe_align_block_size(topk_ids, block_size, num_experts) -> (sorted_ids,
    expert_ids, num_tokens_post_pad), the same outputs as moe_serve.kernels.moe.align: a CUDA kernel,
    so None without a GPU."""
    return load(ALIGN_OP) if torch.cuda.is_available() else None


@functools.lru_cache(maxsize=None)
def fused_experts() -> tuple[Callable, Callable] | None:
    """(fused_experts, fp8_w8a8_moe_quant_config): vLLM's Triton MoE, the timing baseline."""
    fx, qcfg = load(FUSED_EXPERTS), load(FP8_QUANT_CONFIG)
    return (fx, qcfg) if fx is not None and qcfg is not None else None
