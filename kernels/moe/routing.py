"""Per-case backend routing tables: our kernel or vLLM's, from measurements on the device.

The table (``routing,device={device}.json`` in kernels/moe/configs/, or the dir in
$MOE_SERVE_KERNEL_CONFIG_DIR, searched first) is written by kernels/tuning/make_routing.py from
`moe-serve bench kernels` results.json files, or by `moe-serve tune`. Per shape key
``E={E},N={N},K={K},dtype={dtype}`` it holds M ranges, each routed to "ours" or "vllm", and the
measured points (vLLM's time / ours) with the reason for each point's route::

    {"device": "NVIDIA_H200", "triton_version": "3.6.0", "spread": 0.025, "shapes": {
        "E=8,N=1792,K=4096,dtype=bf16": {"name": "Mixtral-8x7B/TP8", "topk": 2,
            "ranges": [{"m_min": 1, "m_max": 256, "backend": "ours"},
                       {"m_min": 257, "m_max": null, "backend": "vllm"}],
            "measured": {"1": {"speedup": 1.26, "route": "ours", "why": "..."}, ...}}}}

Tables are merged over the config dirs (moe_serve.kernels.moe.configs.labelled_dirs: the env override,
the tuner's cache, the shipped tables), the first file that names a shape wins for that shape.
A file that records another ``triton_version`` than the running Triton's is refused with a
warning, as kernel config tables are. Shapes no table names route by the default rule
(default_ranges): ours for the M buckets the decode path serves by default
(heuristics.use_decode_path: few tokens per expert, where that path beat the aligned one in
every measured cell), vLLM above. Which backend serves an M is moe_serve.kernels.moe.selection's decision.

The setting ``moe_routing`` (kernels/config.py; env ``MOE_SERVE_MOE_ROUTING``): ``table``
(default), ``ours`` (always ours where supported: A/B benchmarks, the CPU tests), ``vllm`` (never
ours).
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from moe_serve.kernels.config import current, env_name
from moe_serve.kernels.moe import configs, heuristics

ROUTING_ENV = env_name("moe_routing")
OURS, VLLM = "ours", "vllm"
logger = logging.getLogger(__name__)


def file_name(device: str) -> str:
    return f"routing,device={device}.json"


def shape_key(E: int, N: int, K: int, dtype: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype}"


def policy() -> str:
    """'table', 'ours' or 'vllm': the process's moe_routing setting."""
    return current().moe_routing


@functools.lru_cache(maxsize=None)
def load(device: str, triton_version: str | None = None) -> dict[str, Any] | None:
    """All usable routing files for device merged: {"device", "shapes", "sources", "refused"}
    (each shape entry gains "source": its file); None if no file exists."""
    running = triton_version or configs.running_triton_version()
    merged: dict[str, Any] | None = None
    for d in configs.config_dirs(device, running):
        p = Path(d) / file_name(device)
        if not p.is_file():
            continue
        table = json.loads(p.read_text())
        if merged is None:
            merged = {"device": device, "shapes": {}, "sources": [], "refused": []}
        why = configs.version_refusal(p, table.get("triton_version"), running)
        if why:
            logger.warning("moe-serve: routing table refused (%s); %s", why, configs.TUNE_HINT)
            merged["refused"].append(why)
            continue
        merged["sources"].append(str(p))
        for key, ent in table.get("shapes", {}).items():
            merged["shapes"].setdefault(key, {**ent, "source": str(p)})
    return merged


def default_ranges(E: int, N: int, K: int, topk: int) -> list[dict]:
    """Ranges of a shape no table names: ours for the buckets the decode path serves by
    default (a bucket b covers M in (previous bucket, b]), vLLM elsewhere."""
    out: list[dict] = []
    lo = 1
    for b in configs.M_BUCKETS:
        backend = OURS if heuristics.use_decode_path(b, E, topk, N, K) else VLLM
        if out and out[-1]["backend"] == backend:
            out[-1]["m_max"] = b
        else:
            out.append({"m_min": lo, "m_max": b, "backend": backend})
        lo = b + 1
    if out[-1]["backend"] == VLLM:
        out[-1]["m_max"] = None
    else:
        out.append({"m_min": lo, "m_max": None, "backend": VLLM})
    return out


def range_of(rngs: list[dict], M: int) -> dict | None:
    """The range holding M, or None."""
    for r in rngs:
        if r["m_min"] <= M and (r["m_max"] is None or M <= r["m_max"]):
            return r
    return None


def route_in(rngs: list[dict], M: int) -> str:
    """The backend of M's range; vLLM outside every range."""
    r = range_of(rngs, M)
    return r["backend"] if r else VLLM


def format_ranges(rngs: list[dict]) -> str:
    """Compact form for logs and the info metric: '1-16:ours,17+:vllm' ('' if none)."""
    def span(r: dict) -> str:
        if r["m_max"] is None:
            return f"{r['m_min']}+"
        return str(r["m_min"]) if r["m_max"] == r["m_min"] else f"{r['m_min']}-{r['m_max']}"
    return ",".join(f"{span(r)}:{r['backend']}" for r in rngs)
