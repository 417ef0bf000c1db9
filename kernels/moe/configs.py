"""The kernel config tables, and the default config for a shape that has none.

Tables: ``E={E},N={N},K={K},dtype={dtype},device={device}.json`` (schema: moe_serve.kernels.moe.config_schema;
dtype: the layer's moe_serve.kernels.moe.quant_format key, e.g. ``dtype=fp8_w8a8,block_shape=[128,128]``),
keyed by M bucket; M maps to the smallest bucket >= M (else the largest), so the set of
configs, hence of compiled variants, is finite. Searched in order: the kernel_config_dir setting
("env dir"; kernels/config.py, env $MOE_SERVE_KERNEL_CONFIG_DIR), the tuner's cache (the cache
setting's kernels/<device>/triton-<version>, env $MOE_SERVE_CACHE; written by
`moe-serve tune`), then the tables shipped in kernels/moe/configs/. A table that records another
``triton_version`` than the running Triton's is refused with a warning (a config tuned for one
compiler can lose, or fail to fit, under another): the search goes on, and a shape left with no
table runs the default configs until it is re-tuned with `moe-serve tune`. A table without
``triton_version`` is taken as it is.

Default for a shape with no table: the decode path while tokens per expert are few
(heuristics.use_decode_path), else the aligned path with vLLM's own config for the shape
when vLLM is importable on a GPU (moe_serve.kernels.moe.vllm_kernels), else heuristics.aligned_config.
Which of these serves an M, after the shared-memory fit (fit: block-FP8 configs also get
BLOCK_K = the activation group), is moe_serve.kernels.moe.selection's decision.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moe_serve.kernels.config import current
from moe_serve.kernels.moe import heuristics, quant_format, smem, vllm_kernels
from moe_serve.kernels.moe.config_schema import (KEYS, Config, block_k_fits, block_k_of, down_config, validate,
                                       with_block_k)

M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ENV_DIR, TUNER_CACHE, SHIPPED = "env dir", "tuner cache", "shipped table"
TUNE_HINT = "re-tune it on this GPU with `moe-serve tune --model DIR`"

__all__ = ["KEYS", "Config", "block_k_of", "down_config", "validate", "find_table", "load_table",
           "fit"]
logger = logging.getLogger(__name__)


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


def running_triton_version() -> str:
    import triton

    return triton.__version__


def config_file_name(E: int, N: int, K: int, dtype: str, device: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype},device={device}.json"


def bucket_of(M: int, buckets: tuple[int, ...] = M_BUCKETS) -> int:
    """Smallest bucket >= M, else the largest bucket."""
    for b in buckets:
        if M <= b:
            return b
    return buckets[-1]


def cache_dir(device: str | None = None, triton_version: str | None = None) -> Path:
    """Where `moe-serve tune` writes tables for this device and Triton version."""
    root = Path(current().cache or Path.home() / ".cache" / "moe-serve")
    version = triton_version or running_triton_version()
    return root / "kernels" / (device or device_name()) / f"triton-{version}"


def labelled_dirs(device: str | None = None, triton_version: str | None = None) -> list[tuple[str, Path]]:
    """(source, dir) in search order: env dir, tuner cache, shipped tables."""
    env = current().kernel_config_dir
    return (([(ENV_DIR, Path(env))] if env else [])
            + [(TUNER_CACHE, cache_dir(device, triton_version)), (SHIPPED, CONFIG_DIR)])


def config_dirs(device: str | None = None, triton_version: str | None = None) -> list[Path]:
    return [d for _, d in labelled_dirs(device, triton_version)]


def version_refusal(path: Path, recorded: str | None, running: str) -> str | None:
    """Why a table file is refused (None: accepted): it records another Triton version."""
    if recorded is None or recorded == running:
        return None
    return f"{path}: made under Triton {recorded}, this is Triton {running}"


@dataclass(frozen=True)
class TableLookup:
    """The table found for a shape: {bucket: config} with where it came from, or none; and the
    files refused on the way (another Triton version)."""

    table: dict[int, Config] | None
    source: str | None          # ENV_DIR | TUNER_CACHE | SHIPPED
    path: Path | None
    refused: tuple[str, ...] = ()


def lookup(name: str, dirs: list[tuple[str, Path]], running: str,
           parse: Callable[[dict[str, Any]], Any]) -> TableLookup:
    """The first file `name` in dirs ((source, dir) in search order) made under Triton `running`
    (or recording none), its {bucket: config} as parse(raw) gives it; the files refused on the way."""
    refused: list[str] = []
    for source, d in dirs:
        path = d / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        why = version_refusal(path, raw.get("triton_version"), running)
        if why:
            refused.append(why)
            continue
        return TableLookup(parse(raw), source, path, tuple(refused))
    return TableLookup(None, None, None, tuple(refused))


@functools.lru_cache(maxsize=None)
def find_table(E: int, N: int, K: int, dtype: str, device: str,
               triton_version: str | None = None) -> TableLookup:
    """The first table for this shape in the config dirs that is not refused (see the module
    doc); triton_version: the Triton the configs will run under (default: this one)."""
    running = triton_version or running_triton_version()
    found = lookup(config_file_name(E, N, K, dtype, device), labelled_dirs(device, running), running,
                   lambda raw: {int(k): validate(v) for k, v in raw.items() if k.isdigit()})
    for why in found.refused:
        logger.warning("moe-serve: kernel table refused (%s); %s", why, TUNE_HINT)
    return found


def load_table(E: int, N: int, K: int, dtype: str, device: str,
               triton_version: str | None = None) -> dict[int, Config] | None:
    """The tuned table {bucket: config} for this shape, or None when no file is usable."""
    return find_table(E, N, K, dtype, device, triton_version).table


def aligned_default(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                    device: str | None = None) -> Config:
    """The aligned path's untuned config: vLLM's own for the shape on a GPU where vLLM is
    importable (its shipped table for the device, else its default), else our heuristic."""
    on_gpu = (device or device_name()) != "cpu"
    vcfg = vllm_kernels.moe_config(M, E, N, K, topk, dtype) if on_gpu else None
    if vcfg is not None:
        return heuristics.from_vllm_config(vcfg, dtype)
    return heuristics.aligned_config(M, E, N, K, topk, dtype)


def default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                   device: str | None = None) -> Config:
    """The untuned choice for bucket M (see the module doc)."""
    if heuristics.use_decode_path(M, E, topk, N, K):
        return heuristics.decode_config(M, E, N, K, topk, dtype)
    return aligned_default(M, E, N, K, topk, dtype, device)


def default_source(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                   device: str | None = None) -> str:
    """Which default default_config takes for bucket M, in words."""
    if heuristics.use_decode_path(M, E, topk, N, K):
        return "decode-path heuristic"
    on_gpu = (device or device_name()) != "cpu"
    if on_gpu and vllm_kernels.moe_config(M, E, N, K, topk, dtype) is not None:
        return "vLLM's config for the shape"
    return "aligned-path heuristic"


def fit(cfg: Config, dtype: str, act_bytes: int = 2, topk: int = 8) -> Config:
    """cfg made launchable for format `dtype`: block FP8's BLOCK_K (= the activation group),
    then smem.fit (Hopper's shared memory; it lowers stages first, so a block config keeps its
    BLOCK_K)."""
    bs = quant_format.block_shape(dtype)
    if bs:
        cfg = with_block_k(cfg, bs[1])
    cfg = smem.fit(cfg, quant_format.weight_dtype(dtype), act_bytes, topk)
    if bs and not block_k_fits(cfg, bs[1]):
        raise ValueError(f"no shared-memory fit of {cfg} with BLOCK_K {bs[1]} (block FP8)")
    return cfg
