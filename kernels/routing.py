"""Per-case backend routing: our kernel or vLLM's, from measurements on the device.

The table (``routing,device={device}.json`` in kernels/configs/, or the dir in
$MOE_SERVE_KERNEL_CONFIG_DIR, searched first) is written by ``kernels/make_routing.py`` from
bench_kernels' results.json files. Per shape key ``E={E},N={N},K={K},dtype={dtype}`` it holds
M ranges, each routed to "ours" or "vllm"::

    {"device": "NVIDIA_H200", "threshold": 1.02, "shapes": {
        "E=8,N=1792,K=4096,dtype=bf16": {"name": "Mixtral-8x7B/TP8",
            "ranges": [{"m_min": 1, "m_max": 256, "backend": "ours"},
                       {"m_min": 257, "m_max": null, "backend": "vllm"}], "measured": {...}}}}

Anything not in the table (shape never measured, M outside every range, no table for this
device) routes to vLLM: the product promise is "the fastest backend per case", and an
unmeasured case has no evidence that ours is faster.

Env ``MOE_SERVE_MOE_ROUTING``: ``table`` (default), ``ours`` (always ours where supported: A/B
benchmarks, the CPU tests), ``vllm`` (never ours).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

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
    from kernels import configs

    for d in configs.config_dirs():
        p = Path(d) / file_name(device)
        if p.is_file():
            return json.loads(p.read_text())
    return None


def ranges(E: int, N: int, K: int, dtype: str, device: str | None = None) -> list[dict]:
    """The table's M ranges for a shape ([] when the shape or the table is missing)."""
    from kernels import configs

    table = load(device or configs.device_name())
    if not table:
        return []
    return list((table.get("shapes", {}).get(shape_key(E, N, K, dtype)) or {}).get("ranges", []))


def route(E: int, N: int, K: int, dtype: str, M: int, device: str | None = None) -> str:
    """'ours' or 'vllm' for M tokens of this shape (see the module doc)."""
    pol = policy()
    if pol != "table":
        return pol
    return route_in(ranges(E, N, K, dtype, device), M)


def route_in(rngs: list[dict], M: int) -> str:
    for r in rngs:
        if r["m_min"] <= M and (r["m_max"] is None or M <= r["m_max"]):
            return r["backend"]
    return VLLM


def describe(E: int, N: int, K: int, dtype: str, device: str | None = None) -> str:
    """Compact routing summary for the info metric: '1-16:ours,17+:vllm' ('vllm' if none)."""
    pol = policy()
    if pol != "table":
        return f"all:{pol}"
    parts = [f"{r['m_min']}{'+' if r['m_max'] is None else '' if r['m_max'] == r['m_min'] else '-' + str(r['m_max'])}:{r['backend']}"
             for r in ranges(E, N, K, dtype, device)]
    return ",".join(parts) or "all:vllm(unmeasured)"
