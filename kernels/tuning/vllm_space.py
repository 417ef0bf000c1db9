"""Candidate configs of vLLM's own fused-MoE Triton kernel (`fused_moe_kernel`) for one layer
shape and format, and the static pruning they pass before anything is compiled.

A config is the six keys vLLM's tuner writes (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps,
num_stages); one config serves both GEMMs of a call. Candidates come from
  - vLLM's default for M (its `get_default_config`), the baseline every M is timed against;
  - every table vLLM ships for the same E and N (its fused_moe/configs folder: other GPUs, other
    formats), each table's configs at every M key;
  - vLLM's own tuner's search space (benchmarks/kernels/benchmark_moe.py,
    get_configs_compute_bound, CUDA branch; block FP8 keeps BLOCK_SIZE_N and BLOCK_SIZE_K
    multiples of the block, as it does), walked from the best so far one or two keys at a time.
Pruned: shared memory over the sm_90 limit even at the pipeliner's smallest allocation
((num_stages - 1) stages of A and B tiles; compiled sizes prune the rest), tiles wider than
both GEMMs' padded dims, and exact duplicates of what vLLM launches (block FP8 clamps
BLOCK_SIZE_K to the block; GROUP_SIZE_M values >= the M tiles of a call give one schedule).
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterable

from moe_serve.kernels.moe import quant_format, vllm_kernels
from moe_serve.kernels.moe.smem import SMEM_LIMIT

Config = dict[str, int]
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
SPACE: dict[str, tuple[int, ...]] = {       # benchmark_moe.py get_configs_compute_bound (CUDA)
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}
TUNER_MS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
DECODE_MAX_M = 256                          # M keys searched thoroughly; larger ones on less time
_FUSED_MOE = "vllm.model_executor.layers.fused_moe.fused_moe"
FILE_NAME = (_FUSED_MOE, "get_config_file_name")
DEFAULT_CONFIG = (_FUSED_MOE, "get_default_config")
MODULE = (_FUSED_MOE.rsplit(".", 1)[0], "fused_moe")
OVERRIDE_CONFIG = (_FUSED_MOE.rsplit(".", 1)[0], "override_config")   # forces a config


def canonical(cfg: dict[str, Any]) -> Config | None:
    """The six tuner keys of a table entry (AMD keys such as waves_per_eu dropped); None when
    one is missing (int4/int8 weight-only tables leave BLOCK_SIZE_N/K to the kernel)."""
    if not all(isinstance(cfg.get(k), int) for k in KEYS):
        return None
    return {k: int(cfg[k]) for k in KEYS}


def vllm_format(fmt: str) -> tuple[str | None, list[int] | None]:
    """vLLM's (config dtype, block_shape) of a moe_serve.kernels.moe.quant_format key."""
    return vllm_kernels.vllm_dtype(fmt)


def file_name(E: int, N: int, fmt: str) -> str:
    """vLLM's own table file name for this GPU (E experts, N per-rank intermediate size)."""
    fn = vllm_kernels.load(FILE_NAME)
    if fn is None:
        raise RuntimeError("vLLM is not importable: its fused-MoE config file names come from it")
    return fn(E, N, *vllm_format(fmt))


def default_config(M: int, E: int, N: int, K: int, topk: int, fmt: str) -> Config:
    """vLLM's get_default_config for M tokens (what it runs where no table lists the shape)."""
    fn = vllm_kernels.load(DEFAULT_CONFIG)
    if fn is None:
        raise RuntimeError("vLLM is not importable")
    dtype, block = vllm_format(fmt)
    cfg = canonical({"GROUP_SIZE_M": 1, **fn(M, E, N, K, topk, dtype, block)})
    assert cfg is not None, "vLLM's default config lacks a tuner key"
    return cfg


def configs_dir() -> Path | None:
    """The installed vLLM's fused_moe/configs folder (None without vLLM)."""
    mod = vllm_kernels.load(MODULE)
    return None if mod is None else Path(mod.__file__).parent / "configs"


def _format_of(name: str) -> str:
    """The dtype part of a vLLM table name ('' unquantized, 'fp8_w8a8', 'fp8_w8a8,block_shape=..')."""
    stem = name[:-len(".json")]
    return stem.split(",dtype=", 1)[1] if ",dtype=" in stem else ""


def shipped_tables(E: int, N: int, fmt: str, folder: Path | None = None
                   ) -> tuple[dict[str, dict[int, Config]], dict[str, dict[int, Config]]]:
    """Every table vLLM ships for E and N: ({file name: {M: config}} of this format, the same for
    the other formats whose configs the kernel can run here (not int4/int8 weight-only))."""
    folder = folder or configs_dir()
    dtype, block = vllm_format(fmt)
    want = "" if dtype is None else dtype + (f",block_shape=[{block[0]},{block[1]}]" if block else "")
    same: dict[str, dict[int, Config]] = {}
    other: dict[str, dict[int, Config]] = {}
    if folder is None or not folder.is_dir():
        return same, other
    for path in sorted(folder.glob(f"E={E},N={N},device_name=*.json")):
        fmt_of = _format_of(path.name)
        if fmt_of not in ("", "fp8_w8a8") and not fmt_of.startswith("fp8_w8a8,block_shape="):
            continue
        raw = json.loads(path.read_text())
        table = {int(m): c for m, c in ((m, canonical(v)) for m, v in raw.items() if m.isdigit())
                 if c is not None}
        if table:
            (same if fmt_of == want else other)[path.name] = table
    return same, other


def nearest(table: dict[int, Config], M: int) -> Config:
    """The entry vLLM would pick for M (the key nearest to M, the smaller on a tie)."""
    return table[min(sorted(table), key=lambda k: abs(k - M))]


def search_space(fmt: str) -> list[Config]:
    """vLLM's tuner's search space for this format, in its order."""
    block = quant_format.block_shape(fmt)
    out = []
    for values in itertools.product(*SPACE.values()):
        cfg = dict(zip(KEYS, values))
        if block and (cfg["BLOCK_SIZE_K"] % block[1] or cfg["BLOCK_SIZE_N"] % block[0]):
            continue
        out.append(cfg)
    return out


def effective(cfg: Config, fmt: str) -> Config:
    """The config as vLLM's launcher runs it: block FP8 clamps BLOCK_SIZE_K to the block."""
    block = quant_format.block_shape(fmt)
    if block and cfg["BLOCK_SIZE_K"] > min(block):
        return {**cfg, "BLOCK_SIZE_K": min(block)}
    return cfg


def smem_floor(cfg: Config, fmt: str) -> int:
    """Bytes of shared memory the config needs at least: (num_stages - 1) stages of the A and B
    tiles (Triton's sm_90 pipeliner allocates num_stages - 1 for mma.sync, num_stages for wgmma)."""
    width = 1 if quant_format.is_fp8(fmt) else 2       # W8A8: both operands fp8
    tile = (cfg["BLOCK_SIZE_M"] + cfg["BLOCK_SIZE_N"]) * cfg["BLOCK_SIZE_K"] * width
    return (cfg["num_stages"] - 1) * tile


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def legal(cfg: Config, fmt: str, N: int, K: int) -> bool:
    """Fits sm_90's shared memory at the floor and is no wider than both GEMMs' padded dims
    (GEMM1: 2N outputs over K; GEMM2: K outputs over N)."""
    return (smem_floor(cfg, fmt) <= SMEM_LIMIT
            and cfg["BLOCK_SIZE_N"] <= max(32, _pow2_ceil(max(2 * N, K)))
            and cfg["BLOCK_SIZE_K"] <= max(64, _pow2_ceil(max(N, K))))


def m_tiles(cfg: Config, M: int, E: int, topk: int) -> int:
    """Upper bound of the M tiles one GEMM of a call launches (vLLM's padded sorted ids:
    M * topk + E * (BLOCK_SIZE_M - 1), capped at M * topk * BLOCK_SIZE_M below BLOCK_SIZE_M)."""
    bm = cfg["BLOCK_SIZE_M"]
    em = M * topk + E * (bm - 1)
    if M < bm:
        em = min(em, M * topk * bm)
    return -(-em // bm)


def schedule_key(cfg: Config, M: int, E: int, topk: int) -> tuple:
    """Configs with one key launch the same programs in the same order at M: GROUP_SIZE_M values
    at or above the call's M tiles group all of them."""
    tiles = m_tiles(cfg, M, E, topk)
    group = cfg["GROUP_SIZE_M"] if cfg["GROUP_SIZE_M"] < tiles else tiles
    return tuple(cfg[k] for k in KEYS if k != "GROUP_SIZE_M") + (group,)


def prune(cands: Iterable[Config], fmt: str, N: int, K: int) -> list[Config]:
    """The legal candidates as vLLM runs them, first occurrence kept, order kept."""
    out: list[Config] = []
    for c in cands:
        c = effective(c, fmt)
        if legal(c, fmt, N, K) and c not in out:
            out.append(c)
    return out


def neighbours(cfg: Config, fmt: str, N: int, K: int, pairs: bool = False) -> list[Config]:
    """vLLM's search space around cfg: every other value of one key (pairs: of two keys at once,
    BLOCK_SIZE_M kept), legal and as vLLM runs them."""
    space = {k: v for k, v in SPACE.items()}
    block = quant_format.block_shape(fmt)
    if block:
        space["BLOCK_SIZE_N"] = tuple(v for v in space["BLOCK_SIZE_N"] if v % block[0] == 0)
        space["BLOCK_SIZE_K"] = tuple(v for v in space["BLOCK_SIZE_K"] if v % block[1] == 0)
    out = []
    if not pairs:
        for k in KEYS:
            out += [{**cfg, k: v} for v in space[k] if v != cfg[k]]
    else:
        keys = [k for k in KEYS if k != "BLOCK_SIZE_M"]
        for a, b in itertools.combinations(keys, 2):
            out += [{**cfg, a: va, b: vb} for va in space[a] for vb in space[b]
                    if va != cfg[a] and vb != cfg[b]]
    return [c for c in prune(out, fmt, N, K) if c != effective(cfg, fmt)]


def by_distance(cands: list[Config], to: Config) -> list[Config]:
    """cands ordered by how many keys differ from `to` (then their given order)."""
    return sorted(cands, key=lambda c: sum(c[k] != to[k] for k in KEYS))
