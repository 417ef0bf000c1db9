"""Kernel configs: JSON files keyed by M bucket, plus a default heuristic for untuned shapes.

File name: ``E={E},N={N},K={K},dtype={dtype},device={device}.json`` in kernels/configs/ (or the
dir in $MOE_SERVE_KERNEL_CONFIG_DIR, searched first). Content::

    {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
           "num_stages": 4, "SWAP_AB": true, "DOWN": {...same keys but BLOCK_M...}}, ...}

The top-level entry is GEMM1 (gate/up); "DOWN" (optional) overrides it for GEMM2. Both share
BLOCK_M (one alignment). M is mapped to the smallest bucket >= M (else the largest), so the
set of configs, hence of compiled variants, is finite.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SWAP_AB")
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
NUM_SMS_DEFAULT = 132  # H100/H200 SXM

Config = dict[str, Any]


def device_name() -> str:
    """File-name form of the current device ('NVIDIA_H200' for the H200 family, else 'cpu')."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def config_file_name(E: int, N: int, K: int, dtype: str, device: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype},device={device}.json"


def bucket_of(M: int, buckets: tuple[int, ...] = M_BUCKETS) -> int:
    """Smallest bucket >= M, else the largest bucket."""
    for b in buckets:
        if M <= b:
            return b
    return buckets[-1]


def validate(cfg: Config) -> Config:
    """Check a config's keys and the tl.dot / wgmma constraints; return it normalised."""
    missing = [k for k in KEYS if k not in cfg]
    if missing:
        raise ValueError(f"config {cfg} lacks {missing}")
    out = {k: (bool(cfg[k]) if k == "SWAP_AB" else int(cfg[k])) for k in KEYS}
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = out[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{k}={v} must be a power of two >= 16")
    down = cfg.get("DOWN")
    if down:
        d = validate({**out, **{k: v for k, v in down.items() if k != "BLOCK_M"}})
        out["DOWN"] = {k: d[k] for k in KEYS if k != "BLOCK_M"}
    return out


def _tile_n(n_out: int, active_blocks: int, allow_small: bool, num_sms: int) -> int:
    """Largest BLOCK_N in {128, 64, (32, 16)} that still gives ~num_sms programs."""
    choices = (128, 64, 32, 16) if allow_small else (128, 64)
    for bn in choices:
        if active_blocks * -(-n_out // bn) >= num_sms:
            return bn
    return choices[-1]


def default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                   num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """Heuristic config for bucket M. Decode is weight-bandwidth bound: choose tiles that
    give >= ~1 wave of programs over the SMs, swap AB while BLOCK_M < 64 (weight rows in
    wgmma's M slot), deep pipelines at small M; large M uses 128-wide tiles."""
    fp8 = dtype.startswith("fp8")
    slots = M * topk
    tokens_per_expert = slots / E
    block_m = 16 if tokens_per_expert <= 16 else 32 if tokens_per_expert <= 32 else \
        64 if tokens_per_expert <= 96 else 128
    active_blocks = max(1, min(slots, E)) if block_m < 64 else max(1, slots // block_m)
    swap = block_m < 64
    bk = 128 if fp8 else 64
    if block_m <= 32:
        bk = 256 if fp8 else 128
    stages = 4 if block_m <= 32 else 3
    gate = {"BLOCK_M": block_m, "BLOCK_K": min(bk, max(16, 1 << (K - 1).bit_length())),
            "GROUP_M": 1 if tokens_per_expert < 128 else 8,
            "num_warps": 4 if block_m <= 64 else 8, "num_stages": stages}
    bn1 = _tile_n(N, active_blocks, not swap, num_sms)
    bn2 = _tile_n(K, active_blocks, not swap, num_sms)
    if block_m >= 128:
        bn1 = bn2 = 128
    cfg = {**gate, "BLOCK_N": bn1, "SWAP_AB": swap}
    down_bk = min(bk, max(16, 1 << (N - 1).bit_length()))
    cfg["DOWN"] = {"BLOCK_N": bn2, "BLOCK_K": down_bk, "GROUP_M": gate["GROUP_M"],
                   "num_warps": gate["num_warps"], "num_stages": stages, "SWAP_AB": swap}
    return validate(cfg)


def config_dirs() -> list[Path]:
    env = os.environ.get("MOE_SERVE_KERNEL_CONFIG_DIR")
    return ([Path(env)] if env else []) + [CONFIG_DIR]


@functools.lru_cache(maxsize=None)
def load_table(E: int, N: int, K: int, dtype: str, device: str) -> dict[int, Config] | None:
    """The tuned table {bucket: config} for this shape, or None when no file matches."""
    name = config_file_name(E, N, K, dtype, device)
    for d in config_dirs():
        path = d / name
        if path.is_file():
            raw = json.loads(path.read_text())
            return {int(k): validate(v) for k, v in raw.items() if k.isdigit()}
    return None


@functools.lru_cache(maxsize=4096)
def get_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
               device: str | None = None) -> Config:
    """Config for M tokens: tuned table entry for M's bucket, else the default heuristic."""
    device = device or device_name()
    table = load_table(E, N, K, dtype, device)
    if table:
        keys = tuple(sorted(table))
        return table[bucket_of(M, keys)]
    return default_config(bucket_of(M), E, N, K, topk, dtype)


def buckets_for(E: int, N: int, K: int, dtype: str, device: str | None = None) -> tuple[int, ...]:
    """The M buckets that select configs for this shape (tuned keys or M_BUCKETS)."""
    table = load_table(E, N, K, dtype, device or device_name())
    return tuple(sorted(table)) if table else M_BUCKETS


def down_config(cfg: Config) -> Config:
    """GEMM2's config: cfg with its DOWN overrides applied."""
    return {**{k: cfg[k] for k in KEYS}, **cfg.get("DOWN", {})}
