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
small-batch path of moe_serve.kernels.moe.moe_decode: BLOCK_M >= M * topk rows; SPLIT_K splits the up
kernel's K loop, DOWN's SPLIT_K the down kernel's slot x N loop, both reduced in-kernel by the
tile's last program), "PDL" (decode only: the down kernel is a programmatic dependent launch),
"PREFETCH" (decode only, not GEMV: 0 none, the default, kept in the dict only where nonzero; the up
kernel prefetches the hit experts' down weights into L2, 1 as it starts, 2 after its K loop) and
"GEMV" (decode only: the CUDA-core kernels of moe_serve.kernels.moe.moe_gemv, one slot per program; BLOCK_N
(>= 1) weight rows of BLOCK_K columns per step in registers, num_warps / num_stages / SPLIT_K per
kernel, SWAP_AB false; block FP8 takes any multiple of the activation group as BLOCK_K).
"""
from __future__ import annotations

from typing import Any

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SWAP_AB")
MAX_SPLIT_K = 16
PREFETCH_MODES = (0, 1, 2)

Config = dict[str, Any]


def validate(cfg: Config, gemv: bool = False) -> Config:
    """Check a config's keys and the tl.dot / wgmma constraints (a GEMV config's, with `gemv`
    for its DOWN part); return it normalised."""
    missing = [k for k in KEYS if k not in cfg]
    if missing:
        raise ValueError(f"config {cfg} lacks {missing}")
    out = {k: (bool(cfg[k]) if k == "SWAP_AB" else int(cfg[k])) for k in KEYS}
    out["SPLIT_K"] = int(cfg.get("SPLIT_K", 1))
    out["FUSE_GU"] = bool(cfg.get("FUSE_GU", True))
    gemv = gemv or bool(cfg.get("GEMV"))
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = out[k]
        low = 1 if gemv and k == "BLOCK_N" else 16
        if v < low or v & (v - 1):
            raise ValueError(f"{k}={v} must be a power of two >= {low}")
    if gemv and out["SWAP_AB"]:
        raise ValueError("a GEMV config has SWAP_AB false (no MMA to swap)")
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
        if cfg.get("GEMV"):
            out["GEMV"] = True
    elif cfg.get("GEMV"):
        raise ValueError("a GEMV config is a DECODE config")
    pf = cfg.get("PREFETCH", 0)
    if pf not in PREFETCH_MODES:
        raise ValueError(f"PREFETCH={pf!r} must be one of {PREFETCH_MODES}")
    if pf:
        if not cfg.get("DECODE") or cfg.get("GEMV"):
            raise ValueError("PREFETCH is a decode-path (not GEMV) option")
        out["PREFETCH"] = int(pf)
    down = cfg.get("DOWN")
    if down:
        d = validate({**{k: out[k] for k in KEYS}, "SPLIT_K": 1,
                      **{k: v for k, v in down.items() if k not in ("BLOCK_M", "FUSE_GU")}},
                     gemv=bool(out.get("GEMV")))
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


def block_k_fits(cfg: Config, bk: int) -> bool:
    """Whether both GEMMs' K steps suit block FP8 with activation group bk: BLOCK_K == bk (an
    MMA K step is one group), or a multiple of bk on the GEMV path (it scales each group)."""
    if cfg.get("GEMV"):
        return all(b % bk == 0 for b in block_k_of(cfg))
    return block_k_of(cfg) == {bk}


def with_block_k(cfg: Config, bk: int) -> Config:
    """cfg with its K steps fitted to block FP8's activation group bk (block_k_fits): BLOCK_K =
    bk in both GEMMs; a GEMV config keeps a wider power-of-two BLOCK_K."""
    fitted = (lambda b: max(b, bk)) if cfg.get("GEMV") else (lambda b: bk)
    d = down_config(cfg)
    return validate({**cfg, "BLOCK_K": fitted(cfg["BLOCK_K"]),
                     "DOWN": {**cfg.get("DOWN", {}), "BLOCK_K": fitted(d["BLOCK_K"])}})


def label(cfg: Config) -> str:
    """Short name of a config for logs and results ('dec16x32x256/st4|d64x256s/st4/pdl',
    'gemv16x16x512/w4|d8x512/w4/sk4/pdl', '16x64x128s/sk1/d128sk1'); '/q' marks a decode config
    with A_PREQUANT, '/iq' an aligned one without (activations quantized in the K loop), '/pf1' or
    '/pf2' its PREFETCH."""
    d = down_config(cfg)
    if cfg.get("GEMV"):
        sk1, sk2 = cfg.get("SPLIT_K", 1), d.get("SPLIT_K", 1)
        return (f"gemv{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}/w{cfg['num_warps']}"
                f"{f'/sk{sk1}' if sk1 > 1 else ''}|d{d['BLOCK_N']}x{d['BLOCK_K']}/w{d['num_warps']}"
                f"{f'/sk{sk2}' if sk2 > 1 else ''}{'/pdl' if cfg.get('PDL') else ''}")
    if cfg.get("DECODE"):
        sk1, sk2, pf = cfg.get("SPLIT_K", 1), d.get("SPLIT_K", 1), cfg.get("PREFETCH", 0)
        return (f"dec{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
                f"{'s' if cfg['SWAP_AB'] else ''}/st{cfg['num_stages']}"
                f"{f'/sk{sk1}' if sk1 > 1 else ''}|d{d['BLOCK_N']}x"
                f"{d['BLOCK_K']}{'s' if d['SWAP_AB'] else ''}/st{d['num_stages']}"
                f"{f'/sk{sk2}' if sk2 > 1 else ''}{'/pdl' if cfg.get('PDL') else ''}"
                f"{'/q' if prequant(cfg) else ''}{f'/pf{pf}' if pf else ''}")
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
            f"{'s' if cfg['SWAP_AB'] else ''}/sk{cfg.get('SPLIT_K', 1)}"
            f"{'' if cfg.get('FUSE_GU', True) else 'u'}/d{d['BLOCK_N']}sk{d['SPLIT_K']}"
            f"{'' if prequant(cfg) else '/iq'}")
