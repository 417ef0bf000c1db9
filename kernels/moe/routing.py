"""Per-case backend routing: our kernel or vLLM's, from measurements on the device.

The table (``routing,device={device}.json`` in kernels/moe/configs/, or the dir in
$MOE_SERVE_KERNEL_CONFIG_DIR, searched first) is written by ``kernels/tuning/make_routing.py`` from
bench_kernels' results.json files. Per shape key ``E={E},N={N},K={K},dtype={dtype}`` it holds
M ranges, each routed to "ours" or "vllm"::

    {"device": "NVIDIA_H200", "threshold": 1.02, "shapes": {
        "E=8,N=1792,K=4096,dtype=bf16": {"name": "Mixtral-8x7B/TP8",
            "ranges": [{"m_min": 1, "m_max": 256, "backend": "ours"},
                       {"m_min": 257, "m_max": null, "backend": "vllm"}], "measured": {...}}}}

Tables are merged over the config dirs (kernels.moe.configs.config_dirs: the env override, the
tuner's cache, the shipped tables), the first file that names a shape wins for that shape.
A shape no table names routes by the default rule when its top-k is known: ours for the M
buckets the decode path serves by default (heuristics.use_decode_path: few tokens per
expert, where that path beat the aligned one in every measured cell), vLLM above. M outside
every range, or top-k unknown: vLLM.

Env ``MOE_SERVE_MOE_ROUTING``: ``table`` (default), ``ours`` (always ours where supported: A/B
benchmarks, the CPU tests), ``vllm`` (never ours).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from kernels.moe import configs, heuristics

ROUTING_ENV = "MOE_SERVE_MOE_ROUTING"
OURS, VLLM = "ours", "vllm"


def file_name(device: str) -> str:
    return f"routing,device={device}.json"


def shape_key(E: int, N: int, K: int, dtype: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype}"


def policy() -> str:
    v = os.environ.get(ROUTING_ENV, "table").strip().lower() or "table"
    return v if v in ("table", OURS, VLLM) else "table"


@functools.lru_cache(maxsize=None)
def load(device: str) -> dict[str, Any] | None:
    """All routing files for device merged: {"device", "shapes", "sources"}; None if none."""
    merged: dict[str, Any] | None = None
    for d in configs.config_dirs(device):
        p = Path(d) / file_name(device)
        if not p.is_file():
            continue
        table = json.loads(p.read_text())
        if merged is None:
            merged = {"device": device, "shapes": {}, "sources": []}
        merged["sources"].append(str(p))
        for key, ent in table.get("shapes", {}).items():
            merged["shapes"].setdefault(key, ent)
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


def ranges(E: int, N: int, K: int, dtype: str, device: str | None = None,
           topk: int | None = None) -> list[dict]:
    """The M ranges for a shape: the table's, else the default rule's (needs topk), else []."""
    table = load(device or configs.device_name())
    ent = (table or {}).get("shapes", {}).get(shape_key(E, N, K, dtype))
    if ent:
        return list(ent.get("ranges", []))
    return default_ranges(E, N, K, topk) if topk else []


def route(E: int, N: int, K: int, dtype: str, M: int, device: str | None = None,
          topk: int | None = None) -> str:
    """'ours' or 'vllm' for M tokens of this shape (see the module doc)."""
    pol = policy()
    if pol != "table":
        return pol
    return route_in(ranges(E, N, K, dtype, device, topk), M)


def route_in(rngs: list[dict], M: int) -> str:
    for r in rngs:
        if r["m_min"] <= M and (r["m_max"] is None or M <= r["m_max"]):
            return r["backend"]
    return VLLM


def describe(E: int, N: int, K: int, dtype: str, device: str | None = None,
             topk: int | None = None) -> str:
    """Compact routing summary for the info metric: '1-16:ours,17+:vllm' ('vllm' if none)."""
    pol = policy()
    if pol != "table":
        return f"all:{pol}"
    parts = [f"{r['m_min']}{'+' if r['m_max'] is None else '' if r['m_max'] == r['m_min'] else '-' + str(r['m_max'])}:{r['backend']}"
             for r in ranges(E, N, K, dtype, device, topk)]
    return ",".join(parts) or "all:vllm(unmeasured)"
