"""Kernel configs: JSON files keyed by M bucket, plus a default heuristic for untuned shapes.

File name: ``E={E},N={N},K={K},dtype={dtype},device={device}.json`` in kernels/configs/ (or the
dir in $MOE_SERVE_KERNEL_CONFIG_DIR, searched first). Content::

    {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
           "num_stages": 4, "SWAP_AB": true, "DOWN": {...same keys but BLOCK_M...}}, ...}

The top-level entry is GEMM1 (gate/up); "DOWN" (optional) overrides it for GEMM2. Both share
BLOCK_M (one alignment). Optional keys: "SPLIT_K" (default 1; K-splits reduced with fp32
atomics, GEMM1's and DOWN's independent) and "FUSE_GU" (GEMM1 only, default true: one program
computes both the gate and the up tile; false: 2N/BLOCK_N programs). GEMM1 with SPLIT_K > 1 or
FUSE_GU false writes the fp32 pre-activation and GEMM2 applies SiLU-and-mul on load. M is mapped to the smallest bucket >= M (else the largest), so the
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
OPTIONAL = {"SPLIT_K": 1, "FUSE_GU": True}   # absent in older files: today's fused path
MAX_SPLIT_K = 16
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
    out["SPLIT_K"] = int(cfg.get("SPLIT_K", 1))
    out["FUSE_GU"] = bool(cfg.get("FUSE_GU", True))
    if cfg.get("DECODE"):
        out["DECODE"] = True
        out["PDL"] = bool(cfg.get("PDL", False))
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = out[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{k}={v} must be a power of two >= 16")
    sk = out["SPLIT_K"]
    if sk < 1 or sk & (sk - 1) or sk > MAX_SPLIT_K:
        raise ValueError(f"SPLIT_K={sk} must be a power of two in 1..{MAX_SPLIT_K}")
    down = cfg.get("DOWN")
    if down:
        d = validate({**{k: out[k] for k in KEYS}, "SPLIT_K": 1,
                      **{k: v for k, v in down.items() if k not in ("BLOCK_M", "FUSE_GU")}})
        out["DOWN"] = {k: d[k] for k in KEYS + ("SPLIT_K",) if k != "BLOCK_M"}
    return out


def _tile_n(n_out: int, active_blocks: int, allow_small: bool, num_sms: int) -> int:
    """Largest BLOCK_N in {128, 64, (32, 16)} that still gives ~num_sms programs."""
    choices = (128, 64, 32, 16) if allow_small else (128, 64)
    for bn in choices:
        if active_blocks * -(-n_out // bn) >= num_sms:
            return bn
    return choices[-1]


def split_k_for(programs: int, k_tiles: int, target: int, min_tiles: int = 2) -> int:
    """Smallest power-of-two SPLIT_K giving >= target programs, keeping >= min_tiles K tiles
    per split (each program must still stream a pipeline's worth of weight)."""
    s = 1
    while programs * s < target and s * 2 <= MAX_SPLIT_K and k_tiles >= 2 * s * min_tiles:
        s *= 2
    return s


def default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                   num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """Heuristic config for bucket M. Decode is weight-bandwidth bound: choose tiles that
    give >= ~1 wave of programs over the SMs, swap AB while BLOCK_M < 64 (weight rows in
    wgmma's M slot), deep pipelines at small M; large M uses 128-wide tiles.

    Small M: when GEMM1's fused gate+up grid (hit experts x N/BLOCK_N) is under ~2 programs
    per SM, un-fuse gate/up (2N/BLOCK_N programs, each half the bytes) and split K until the
    grid reaches ~2 x num_sms; GEMM2 likewise splits K (its reduction dim N) when
    hit experts x K/BLOCK_N is short."""
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
    cfg = {**gate, "BLOCK_N": bn1, "SWAP_AB": swap, "SPLIT_K": 1, "FUSE_GU": True}
    down_bk = min(bk, max(16, 1 << (N - 1).bit_length()))
    down = {"BLOCK_N": bn2, "BLOCK_K": down_bk, "GROUP_M": gate["GROUP_M"],
            "num_warps": gate["num_warps"], "num_stages": stages, "SWAP_AB": swap, "SPLIT_K": 1}
    target = 2 * num_sms
    if block_m < 64:
        p1 = active_blocks * -(-N // bn1)
        if p1 < target:
            bn1 = 64 if swap else bn1
            cfg["BLOCK_N"] = bn1
            cfg["FUSE_GU"] = False
            p1 = active_blocks * -(-2 * N // bn1)
            cfg["SPLIT_K"] = split_k_for(p1, -(-K // cfg["BLOCK_K"]), target)
        p2 = active_blocks * -(-K // bn2)
        down["SPLIT_K"] = split_k_for(p2, -(-N // down_bk), target)
        if down["SPLIT_K"] > 1 or not cfg["FUSE_GU"]:  # fp32 h tiles double A's smem
            down["num_stages"] = min(stages, 3)
    # stages beyond a program's K tiles only cost shared memory (hence occupancy)
    cfg["num_stages"] = max(2, min(cfg["num_stages"],
                                   -(-K // (cfg["BLOCK_K"] * cfg["SPLIT_K"]))))
    down["num_stages"] = max(2, min(down["num_stages"], -(-N // (down_bk * down["SPLIT_K"]))))
    cfg["DOWN"] = down
    return validate(cfg)


def expected_experts(M: int, E: int, topk: int) -> float:
    """Expected number of distinct experts hit by M tokens under uniform top-k routing."""
    return E * (1.0 - (1.0 - min(topk, E) / E) ** M)


def decode_block_m(M: int, topk: int) -> int:
    """Rows of the decode path's A tile: all M * topk slots, padded to a power of two >= 16."""
    return max(16, 1 << (M * topk - 1).bit_length())


def decode_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                  num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """Heuristic config of the two-launch decode path (kernels.moe_decode) for bucket M.

    Up kernel: programs = hit experts x N / BLOCK_N x SPLIT_K; take the widest weight tile
    that still gives ~2 programs per SM (swapped 64-row tiles for wgmma, else 32 or 16 rows
    with mma.sync), then split K if even 16-row tiles leave SMs idle. Down kernel: programs
    = M x K / BLOCK_N, same rule. BLOCK_K: 256 B of weight per row and stage."""
    fp8 = dtype.startswith("fp8")
    target = 2 * num_sms
    d = max(1.0, expected_experts(M, E, topk))
    bk = 256 if fp8 else 128
    choices = ((True, 64), (False, 32), (False, 16))
    swap1, bn1 = next(((sw, bn) for sw, bn in choices if d * -(-N // bn) >= target),
                      choices[-1])
    split = split_k_for(int(d * -(-N // bn1)), -(-K // bk), target, min_tiles=4)
    swap2, bn2 = next(((sw, bn) for sw, bn in choices if M * -(-K // bn) >= target),
                      choices[-1])
    bk1 = min(bk, max(16, 1 << (K - 1).bit_length()))
    bk2 = min(bk, max(16, 1 << (N - 1).bit_length()))
    cfg = {"DECODE": True, "BLOCK_M": decode_block_m(M, topk), "BLOCK_N": bn1, "BLOCK_K": bk1,
           "GROUP_M": 1, "num_warps": 4, "num_stages": 4, "SWAP_AB": swap1, "SPLIT_K": split,
           "FUSE_GU": True,
           "DOWN": {"BLOCK_N": bn2, "BLOCK_K": bk2, "GROUP_M": 1, "num_warps": 4,
                    "num_stages": 4 if split == 1 else 2, "SWAP_AB": swap2, "SPLIT_K": 1}}
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
               device: str | None = None, act_bytes: int = 2) -> Config:
    """Config for M tokens: tuned table entry for M's bucket, else the default heuristic;
    either way fitted to Hopper's 227 KB of shared memory per CTA (kernels.smem.fit: fewer
    stages, then smaller BLOCK_K). act_bytes: itemsize of fp8 layers' hidden states (bf16 2)."""
    from kernels import smem

    device = device or device_name()
    table = load_table(E, N, K, dtype, device)
    if table:
        keys = tuple(sorted(table))
        cfg = table[bucket_of(M, keys)]
    else:
        cfg = default_config(bucket_of(M), E, N, K, topk, dtype)
    return smem.fit(cfg, dtype, act_bytes)


def buckets_for(E: int, N: int, K: int, dtype: str, device: str | None = None) -> tuple[int, ...]:
    """The M buckets that select configs for this shape (tuned keys or M_BUCKETS)."""
    table = load_table(E, N, K, dtype, device or device_name())
    return tuple(sorted(table)) if table else M_BUCKETS


def down_config(cfg: Config) -> Config:
    """GEMM2's config: cfg with its DOWN overrides applied (SPLIT_K only from DOWN)."""
    return {**{k: cfg[k] for k in KEYS}, "SPLIT_K": 1, **cfg.get("DOWN", {})}
