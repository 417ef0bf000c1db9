"""Markdown of the expert-kernel bench (run.py's results.json): one row per shape and format.

Per (shape, format): the M measured, ours over vLLM's `fused_experts` as a geometric mean over
M <= 64 (decode and small batches) and over M > 64, the lowest ratio of any M, what serving gets
at its worst M (vLLM's kernel where the routing table sends that M to it: 1.0), and at M = 1 ours
and vLLM's time over the streaming floor of the same expert bytes (floor.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PARTS = ("bench", "untuned", "format-bench", "quick-bench")


def rows_of(*files: Path) -> list[dict[str, Any]]:
    """Every measured row of the bench parts in the results files; a later file's row replaces an
    earlier one of the same (shape, format, M)."""
    out: dict[tuple, dict[str, Any]] = {}
    for f in files:
        data = json.loads(Path(f).read_text())
        for part in PARTS:
            for r in data.get(part) or []:
                out[(r["shape"], r["dtype"], r["M"])] = {**r, "source": Path(f).name}
    return list(out.values())


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _x(v: float | None, bold_above: float | None = None) -> str:
    if v is None:
        return "—"
    text = f"{v:.2f}"
    return f"**{text}**" if bold_above is not None and v > bold_above else text


def shape_table(*files: Path) -> list[str]:
    """The per-shape summary table of the results files (see the module docstring)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows_of(*files):
        groups.setdefault((r["shape"], r["dtype"]), []).append(r)
    out = ["| shape (E, N, K, top-k per rank) | format | tuned | M measured | ours / vLLM, geomean M <= 64 "
           "| geomean M > 64 | lowest | served, lowest | M = 1: ours / floor | M = 1: vLLM / floor |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (shape, fmt), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["M"])
        sp = [(r["M"], r["speedup"]) for r in rs if r.get("speedup")]
        served = [r.get("served_speedup") for r in rs if r.get("served_speedup") is not None]
        one = next((r for r in rs if r["M"] == 1), {})
        ms = [r["M"] for r in rs]
        out.append(f"| {shape} | {fmt} | {'yes' if rs[0].get('tuned') else 'no'} | {ms[0]}..{ms[-1]} ({len(ms)}) | "
                   f"{_x(_geomean([s for m, s in sp if m <= 64]), 1)} | {_x(_geomean([s for m, s in sp if m > 64]), 1)} | "
                   f"{_x(min((s for _, s in sp), default=None))} | {_x(min(served, default=None))} | "
                   f"{_x(one.get('ours_vs_floor'))} | {_x(one.get('vllm_vs_floor'))} |")
    return out
