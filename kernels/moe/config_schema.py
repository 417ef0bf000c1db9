"""The kernel config schema: keys, validation and GEMM2's (DOWN) view of a config.

A config is a dict (JSON in kernels/moe/configs/*.json, one per M bucket)::

    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "SWAP_AB": true, "DOWN": {...same keys but BLOCK_M...}}

The top-level entry is GEMM1 (gate/up); "DOWN" (optional) overrides it for GEMM2. Both share
BLOCK_M. Optional keys: "SPLIT_K" (default 1; K-splits reduced with fp32 atomics, GEMM1's
and DOWN's independent), "FUSE_GU" (GEMM1 only, default true: one program computes both the
gate and the up tile; false: 2N/BLOCK_N programs), "A_PREQUANT" (fp8 with float hidden states:
GEMM1's input quantized once by its own launch, and on the aligned path a dynamic GEMM2 input that
GEMM1's epilogue cannot quantize (per token; block groups wider than its tile) by another, instead
of in every program's K loop; default true on the aligned path, false on the decode path, whose
activations are few rows; kept in the dict only where it differs), "DECODE" (the two-launch
small-batch path of kernels.moe.moe_decode: BLOCK_M >= M * topk rows; SPLIT_K splits the up
kernel's K loop, DOWN's SPLIT_K the down kernel's slot x N loop, both reduced in-kernel by the
tile's last program) and "PDL" (decode only: the down kernel is a programmatic dependent launch).
"""
from __future__ import annotations

from typing import Any

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SWAP_AB")
MAX_SPLIT_K = 16

Config = dict[str, Any]


def validate(cfg: Config) -> Config:
    """Check a config's keys and the tl.dot / wgmma constraints; return it normalised."""
    missing = [k for k in KEYS if k not in cfg]
    if missing:
        raise ValueError(f"config {cfg} lacks {missing}")
    out = {k: (bool(cfg[k]) if k == "SWAP_AB" else int(cfg[k])) for k in KEYS}
    out["SPLIT_K"] = int(cfg.get("SPLIT_K", 1))
    out["FUSE_GU"] = bool(cfg.get("FUSE_GU", True))
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = out[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{k}={v} must be a power of two >= 16")
    sk = out["SPLIT_K"]
    if sk < 1 or sk & (sk - 1) or sk > MAX_SPLIT_K:
        raise ValueError(f"SPLIT_K={sk} must be a power of two in 1..{MAX_SPLIT_K}")
    pre = cfg.get("A_PREQUANT")
    if pre is not None and bool(pre) != (not cfg.get("DECODE")):
        out["A_PREQUANT"] = bool(pre)
    if cfg.get("DECODE"):
        if not out["FUSE_GU"]:
            raise ValueError("a DECODE config has FUSE_GU true")
        out["DECODE"] = True
        out["PDL"] = bool(cfg.get("PDL", False))
    down = cfg.get("DOWN")
    if down:
        d = validate({**{k: out[k] for k in KEYS}, "SPLIT_K": 1,
                      **{k: v for k, v in down.items() if k not in ("BLOCK_M", "FUSE_GU")}})
        out["DOWN"] = {k: d[k] for k in KEYS + ("SPLIT_K",) if k != "BLOCK_M"}
    return out


def prequant(cfg: Config) -> bool:
    """Whether fp8 activations are quantized once (A_PREQUANT, with its per-path default)."""
    return bool(cfg.get("A_PREQUANT", not cfg.get("DECODE")))


def down_config(cfg: Config) -> Config:
    """GEMM2's config: cfg with its DOWN overrides applied (SPLIT_K only from DOWN)."""
    return {**{k: cfg[k] for k in KEYS}, "SPLIT_K": 1, **cfg.get("DOWN", {})}


def block_k_of(cfg: Config) -> set[int]:
    """The K-loop tile widths of both GEMMs."""
    return {cfg["BLOCK_K"], down_config(cfg)["BLOCK_K"]}


def with_block_k(cfg: Config, bk: int) -> Config:
    """cfg with BLOCK_K = bk in both GEMMs (block FP8: one K step is one activation group)."""
    return validate({**cfg, "BLOCK_K": bk, "DOWN": {**cfg.get("DOWN", {}), "BLOCK_K": bk}})


def label(cfg: Config) -> str:
    """Short name of a config for logs and results ('dec16x32x256/st4|d64x256s/st4/pdl',
    '16x64x128s/sk1/d128sk1'); '/q' marks a decode config with A_PREQUANT, '/iq' an aligned
    one without (activations quantized in the K loop)."""
    d = down_config(cfg)
    if cfg.get("DECODE"):
        sk1, sk2 = cfg.get("SPLIT_K", 1), d.get("SPLIT_K", 1)
        return (f"dec{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
                f"{'s' if cfg['SWAP_AB'] else ''}/st{cfg['num_stages']}"
                f"{f'/sk{sk1}' if sk1 > 1 else ''}|d{d['BLOCK_N']}x"
                f"{d['BLOCK_K']}{'s' if d['SWAP_AB'] else ''}/st{d['num_stages']}"
                f"{f'/sk{sk2}' if sk2 > 1 else ''}{'/pdl' if cfg.get('PDL') else ''}"
                f"{'/q' if prequant(cfg) else ''}")
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
            f"{'s' if cfg['SWAP_AB'] else ''}/sk{cfg.get('SPLIT_K', 1)}"
            f"{'' if cfg.get('FUSE_GU', True) else 'u'}/d{d['BLOCK_N']}sk{d['SPLIT_K']}"
            f"{'' if prequant(cfg) else '/iq'}")
