"""Configs of the dense decode GEMV (moe_serve.kernels.dense.gemv): the keys, their checks, the untuned
heuristic, and the tuned tables that override it.

A config is a dict::

    {"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "ACC_PAIRS": true,
     "PREFETCH": true}

BLOCK_N weight rows per program (in each thread's registers), BLOCK_K columns per K step (a
multiple of VEC x 32 x num_warps, VEC = the elements of 16 bytes: the kernel's layout rule),
SPLIT_K programs per row block (a power of two <= MAX_SPLIT_K), ACC_PAIRS (per-token accumulators
keep VEC / 2 lanes: one FMA per product, more registers) and PREFETCH (the next K tile's weights
loaded before this tile's FMAs).

Weight dtype keys: "bf16", "fp16", "fp32" (moe_serve.kernels.dense.gemv, 1..8 tokens) and the FP8 formats
of moe_serve.kernels.dense.gemv_fp8 (1..16 tokens): "fp8_tensor", "fp8_channel" (one scale, one per output
row) and "fp8_block{bn}x{bk}" (a scale per [bn, bk] block), named by fp8_key. VEC, the elements
of one 16-byte weight load, is 8 (bf16, fp16), 4 (fp32) and 16 (FP8).

Tables: ``dense,N={N},K={K},dtype={dtype},device={device}.json``, keyed by BLOCK_M ("1", "2",
"4", "8", and "16" for FP8: M rounded up to a power of two, one compiled variant each), with
"triton_version";
searched like the MoE tables (moe_serve.kernels.moe.configs.labelled_dirs: $MOE_SERVE_KERNEL_CONFIG_DIR,
the tuner's cache) and then in kernels/dense/configs/; a table made under another Triton is
refused with a warning. `moe-serve bench kernels --dense` writes such tables from its sweep,
keeping only the buckets where its best config beat F.linear (cuBLAS; vLLM's FP8 linear for the
FP8 keys) by at least WIN_MARGIN.

The fused residual add + RMSNorm + GEMV (moe_serve.kernels.fused.norm_gemv) keeps its own tables in the
same format and dirs under the kind "norm_gemv" (``norm_gemv,N=...``): the buckets where its best
config beat the unfused chain (`moe-serve bench step --sweep`).

Serving (moe_serve.kernels.dense.op) runs the GEMV only for a (shape, bucket) a table lists (tuned_config):
every other call keeps F.linear. The heuristic (default_config) is the search's starting point
and what a direct dense_gemv call without a table runs.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from moe_serve.kernels.moe import configs as moe_configs

Config = dict[str, Any]
KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "ACC_PAIRS", "PREFETCH")
MAX_SPLIT_K = 16
BUCKETS = (1, 2, 4, 8, 16)          # 16: FP8 weights only (max_m)
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_SMS = 132                   # H100 / H200 SXM: where no GPU is visible (tests, AOT)
PROGRAMS_PER_SM = 4                 # split K until the grid has this many programs per SM
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP8 = "fp8_"                        # the FP8 keys' prefix
DENSE, NORM_GEMV = "dense", "norm_gemv"   # the table kinds
KINDS = (DENSE, NORM_GEMV)
WIN_MARGIN = 0.03                   # a tabled bucket beat F.linear by >= 3 % (timing noise is ~1 %)
logger = logging.getLogger(__name__)


def fp8_key(block: tuple[int, int] | None, per_channel: bool = False) -> str:
    """The dtype key of FP8 weights: 'fp8_block{bn}x{bk}' (scales per [bn, bk] block), else
    'fp8_channel' or 'fp8_tensor'."""
    if block:
        return f"{FP8}block{int(block[0])}x{int(block[1])}"
    return f"{FP8}channel" if per_channel else f"{FP8}tensor"


def is_fp8(dtype: str) -> bool:
    return dtype.startswith(FP8)


def block_of(dtype: str) -> tuple[int, int] | None:
    """(bn, bk) of a block FP8 key, else None."""
    if not dtype.startswith(FP8 + "block"):
        return None
    bn, bk = dtype[len(FP8 + "block"):].split("x")
    return int(bn), int(bk)


def vec(dtype: str) -> int:
    """Elements of one 16-byte load of this weight dtype key."""
    return 16 if is_fp8(dtype) else 16 // DTYPE_BYTES[dtype]


def max_m(dtype: str = "bf16") -> int:
    """Most tokens one launch serves for this weight dtype key: 16 for FP8 (one accumulator per
    token; the 16-bit kernel keeps 8 beside twice the weight registers per byte)."""
    return BUCKETS[-1] if is_fp8(dtype) else BUCKETS[-2]


def bucket(M: int, dtype: str = "bf16") -> int:
    """BLOCK_M for M tokens: the power of two >= M (1 <= M <= max_m(dtype))."""
    if not 1 <= M <= max_m(dtype):
        raise ValueError(f"the dense GEMV serves 1..{max_m(dtype)} tokens of {dtype}, not {M}")
    return 1 << (M - 1).bit_length()


def validate(cfg: Config, dtype: str) -> Config:
    """cfg with every key checked (the layout rule for this dtype included), normalised."""
    missing = [k for k in KEYS if k not in cfg]
    if missing:
        raise ValueError(f"dense GEMV config {cfg} lacks {missing}")
    out = {k: (bool(cfg[k]) if k in ("ACC_PAIRS", "PREFETCH") else int(cfg[k])) for k in KEYS}
    for k, top in (("BLOCK_N", 64), ("num_warps", 16), ("SPLIT_K", MAX_SPLIT_K)):
        v = out[k]
        if v < 1 or v & (v - 1) or v > top:
            raise ValueError(f"dense GEMV {k}={v} must be a power of two in 1..{top}")
    lane = vec(dtype) * 32 * out["num_warps"]
    if out["BLOCK_K"] < lane or out["BLOCK_K"] % lane or out["BLOCK_K"] & (out["BLOCK_K"] - 1):
        raise ValueError(f"dense GEMV BLOCK_K={out['BLOCK_K']} must be a power-of-two multiple of "
                         f"VEC x 32 x num_warps = {lane} for {dtype}")
    block = block_of(dtype)
    if block and block[0] % out["BLOCK_N"]:
        raise ValueError(f"dense GEMV BLOCK_N={out['BLOCK_N']} must divide the scale block's {block[0]} rows "
                         f"({dtype}: a program's rows share one block scale per K group)")
    return out


def label(cfg: Config) -> str:
    """A short name of a config (bench tables, logs)."""
    return (f"n{cfg['BLOCK_N']}k{cfg['BLOCK_K']}s{cfg['SPLIT_K']}w{cfg['num_warps']}"
            f"{'p' if cfg['ACC_PAIRS'] else 't'}{'f' if cfg['PREFETCH'] else ''}")


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def default_config(M: int, N: int, K: int, dtype: str, sms: int = DEFAULT_SMS) -> Config:
    """The untuned config for M tokens of an [N, K] weight on a GPU of `sms` SMs.

    Rows per program by BLOCK_M, so the per-token accumulators, the tokens' x slices and the
    prefetched tile stay near 128 registers (SASS of sm_90: 72-127 registers for these; FP8
    weights widen to twice the fp32 registers per loaded byte, so half the rows: no spills at
    1..16 tokens on sm_90, tests/kernels/_dense_sm90.py); one
    16-byte vector per thread along K (num_warps lowered for K below 4 warps' worth); then split
    K (powers of two, at most the K tiles) until the grid has PROGRAMS_PER_SM programs per SM."""
    bm = bucket(M, dtype)
    block_n, pairs = ({1: (4, True), 2: (4, True), 4: (2, True), 8: (2, True), 16: (1, True)} if is_fp8(dtype)
                      else {1: (8, True), 2: (4, True), 4: (4, True), 8: (2, True)})[bm]
    lane = vec(dtype) * 32
    warps = min(4, _pow2_floor(K // lane)) if K >= lane else 1
    block_k = lane * warps
    programs = -(-N // block_n)
    tiles = -(-K // block_k)
    split = min(MAX_SPLIT_K, _pow2_floor(tiles), _pow2_floor(PROGRAMS_PER_SM * sms // programs))
    return validate({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": warps,
                     "ACC_PAIRS": pairs, "PREFETCH": True}, dtype)


def table_file_name(N: int, K: int, dtype: str, device: str, kind: str = DENSE) -> str:
    """A table's file name: kind "dense" (the GEMV) or "norm_gemv" (the fused norm + GEMV)."""
    if kind not in KINDS:
        raise ValueError(f"table kind {kind!r}: not one of {KINDS}")
    return f"{kind},N={N},K={K},dtype={dtype},device={device}.json"


def table_dirs(device: str, triton_version: str | None = None) -> list[tuple[str, Path]]:
    """Where tables are searched, in order, with their source labels: the MoE tables' env dir and
    tuner cache, then the shipped dir of this package."""
    moe = [(source, d) for source, d in moe_configs.labelled_dirs(device, triton_version)
           if source != moe_configs.SHIPPED]
    return moe + [(moe_configs.SHIPPED, SHIPPED_DIR)]


def find_table(N: int, K: int, dtype: str, device: str, kind: str = DENSE,
               triton_version: str | None = None) -> moe_configs.TableLookup:
    """The first table of this shape and kind the server would accept under `triton_version` (default:
    the running Triton), with its source and path; the files refused on the way (another Triton)."""
    running = triton_version or moe_configs.running_triton_version()
    return moe_configs.lookup(table_file_name(N, K, dtype, device, kind), table_dirs(device, running), running,
                              lambda raw: {int(k): validate(v, dtype) for k, v in raw.items() if k.isdigit()})


@functools.lru_cache(maxsize=None)
def load_table(N: int, K: int, dtype: str, device: str, kind: str = DENSE) -> dict[int, Config] | None:
    """The tuned {BLOCK_M: config} of this shape and kind, or None (no file, or every file refused)."""
    found = find_table(N, K, dtype, device, kind)
    for why in found.refused:
        logger.warning("moe-serve: %s table refused (%s); re-measure it with `%s`", kind, why,
                       "moe-serve tune --model DIR" if kind == DENSE else "moe-serve bench step --sweep")
    return found.table


def table_json(best: dict[int, Config], triton_version: str) -> str:
    """A table file's text for the best config per BLOCK_M (what load_table reads)."""
    body: dict[str, Any] = {str(b): best[b] for b in sorted(best)}
    return json.dumps({**body, "triton_version": triton_version}, indent=1) + "\n"


def tuned_config(M: int, N: int, K: int, dtype: str, device: str) -> Config | None:
    """The tuned table's config for M's bucket of an [N, K] weight on this device, or None (no
    table, or the bucket not listed: F.linear was as fast there)."""
    table = load_table(N, K, dtype, device)
    return table.get(bucket(M, dtype)) if table else None


@functools.lru_cache(maxsize=4096)
def config_for(M: int, N: int, K: int, dtype: str, device: str, sms: int = DEFAULT_SMS) -> Config:
    """The config M tokens of an [N, K] weight run: the tuned table's for M's bucket, else the
    heuristic's."""
    table = load_table(N, K, dtype, device)
    bm = bucket(M, dtype)
    if table and bm in table:
        return table[bm]
    return default_config(M, N, K, dtype, sms)
