"""Which kernel config serves M tokens of a shape: a tuned table, else a default.

Tables: ``E={E},N={N},K={K},dtype={dtype},device={device}.json`` (schema: kernels.moe.config_schema),
keyed by M bucket; M maps to the smallest bucket >= M (else the largest), so the set of
configs, hence of compiled variants, is finite. Searched in order: $MOE_SERVE_KERNEL_CONFIG_DIR,
the tuner's cache ($MOE_SERVE_CACHE/kernels/<device>/triton-<version>, written by
`moe-serve tune`), then the tables shipped in kernels/moe/configs/.

Default for a shape with no table: the decode path while tokens per expert are few
(heuristics.use_decode_path), else the aligned path with vLLM's own config for the shape
when vLLM is importable on a GPU (kernels.moe.vllm_kernels), else heuristics.aligned_config.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from kernels.moe import heuristics, smem, vllm_kernels
from kernels.moe.config_schema import KEYS, Config, down_config, validate

M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"

__all__ = ["KEYS", "Config", "down_config", "validate", "get_config", "load_table"]


def device_file_name(gpu_name: str) -> str:
    """File-name form of a GPU's name ('NVIDIA H200 NVL' -> 'NVIDIA_H200': one H200 family)."""
    name = gpu_name.replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def device_name() -> str:
    """device_file_name of the current CUDA device, or 'cpu'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return device_file_name(torch.cuda.get_device_name())


def config_file_name(E: int, N: int, K: int, dtype: str, device: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype},device={device}.json"


def bucket_of(M: int, buckets: tuple[int, ...] = M_BUCKETS) -> int:
    """Smallest bucket >= M, else the largest bucket."""
    for b in buckets:
        if M <= b:
            return b
    return buckets[-1]


def cache_dir(device: str | None = None) -> Path:
    """Where `moe-serve tune` writes tables for this device and Triton version."""
    import triton

    root = Path(os.environ.get("MOE_SERVE_CACHE", Path.home() / ".cache" / "moe-serve"))
    return root / "kernels" / (device or device_name()) / f"triton-{triton.__version__}"


def config_dirs(device: str | None = None) -> list[Path]:
    env = os.environ.get("MOE_SERVE_KERNEL_CONFIG_DIR")
    return ([Path(env)] if env else []) + [cache_dir(device), CONFIG_DIR]


@functools.lru_cache(maxsize=None)
def load_table(E: int, N: int, K: int, dtype: str, device: str) -> dict[int, Config] | None:
    """The tuned table {bucket: config} for this shape, or None when no file matches."""
    name = config_file_name(E, N, K, dtype, device)
    for d in config_dirs(device):
        path = d / name
        if path.is_file():
            raw = json.loads(path.read_text())
            return {int(k): validate(v) for k, v in raw.items() if k.isdigit()}
    return None


def aligned_default(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                    device: str | None = None) -> Config:
    """The aligned path's untuned config: vLLM's own for the shape on a GPU where vLLM is
    importable (its shipped table for the device, else its default), else our heuristic."""
    on_gpu = (device or device_name()) != "cpu"
    vcfg = vllm_kernels.moe_config(M, E, N, K, topk, dtype) if on_gpu else None
    if vcfg is not None:
        return heuristics.from_vllm_config(vcfg)
    return heuristics.aligned_config(M, E, N, K, topk, dtype)


def default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                   device: str | None = None) -> Config:
    """The untuned choice for bucket M (see the module doc)."""
    if heuristics.use_decode_path(M, E, topk, N, K):
        return heuristics.decode_config(M, E, N, K, topk, dtype)
    return aligned_default(M, E, N, K, topk, dtype, device)


@functools.lru_cache(maxsize=4096)
def get_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
               device: str | None = None, act_bytes: int = 2) -> Config:
    """Config for M tokens: tuned table entry for M's bucket, else the default; either way
    fitted to Hopper's 227 KB of shared memory per CTA (smem.fit). act_bytes: itemsize of
    fp8 layers' hidden states (bf16 2)."""
    device = device or device_name()
    table = load_table(E, N, K, dtype, device)
    if table:
        cfg = table[bucket_of(M, tuple(sorted(table)))]
    else:
        cfg = default_config(bucket_of(M), E, N, K, topk, dtype, device)
    return smem.fit(cfg, dtype, act_bytes, topk)


def buckets_for(E: int, N: int, K: int, dtype: str, device: str | None = None) -> tuple[int, ...]:
    """The M buckets that select configs for this shape (tuned keys or M_BUCKETS)."""
    table = load_table(E, N, K, dtype, device or device_name())
    return tuple(sorted(table)) if table else M_BUCKETS
