"""Kernel level: each fused piece against the unfused chain it replaces, timed from CUDA graphs.

Per case (moe_serve.bench.step.pieces): first the check (fused against the chain on a fresh input set,
or against float64 where the chain is no reference: the FP8 pieces, whose vLLM chain quantizes the
activation; a case whose error passes TOLERANCE, or is NaN, is reported failed and not timed), then the median
us of one call of `fused`, `chain` and each `alt` baseline replayed from a CUDA graph over the rotated
input sets (moe_serve.kernels.tuning.timing.time_graph), and the floor: the case's bytes over the measured
copy ceiling. The prediction a model-level run must confirm: per_step x (chain - fused) us a step.
"""
from __future__ import annotations

import math
import traceback
from typing import Any

from moe_serve.bench.step.pieces import Case

TOLERANCE = 2e-2          # fused against its reference, both rounding to bf16 (each ~4e-3 from float64)


def run_case(case: Case, ceiling_bytes_per_s: float, replays: int) -> dict[str, Any]:
    """One row: the check's errors, then fused / chain / alt us, floor us, predicted saving."""
    from moe_serve.kernels.tuning.timing import time_graph

    row: dict[str, Any] = {"piece": case.piece, "switch": case.switch, "shape": case.shape, "M": case.M,
                           "per_step": case.per_step, "floor_bytes": case.floor_bytes}
    try:
        row["errors"] = case.check()
    except Exception as exc:  # noqa: BLE001 - one case's failure is a row, not the end of the run
        row.update(ok=False, error=f"check: {exc!r}", trace=traceback.format_exc(limit=4))
        return row
    fused_err = row["errors"].get("fused", float("nan"))
    row["ok"] = bool(fused_err <= TOLERANCE) and all(not math.isnan(v) for v in row["errors"].values())
    if not row["ok"]:
        row["error"] = f"fused output off: {row['errors']}"
        return row
    sides = {"fused": case.fused, "chain": case.chain, **{f"alt:{n}": fn for n, fn in case.alt.items()}}
    for side, fn in sides.items():
        try:
            row[f"{side}_us"] = time_graph(fn, case.n_sets, replays)
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is a note, not the end
            row[f"{side}_error"] = repr(exc)[:300]
    if math.isfinite(ceiling_bytes_per_s):
        row["floor_us"] = case.floor_bytes / ceiling_bytes_per_s * 1e6
    if "fused_us" in row and "chain_us" in row:
        row["chain_over_fused"] = row["chain_us"] / row["fused_us"]
        row["saved_us_per_step"] = case.per_step * (row["chain_us"] - row["fused_us"])
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The kernel-level table (markdown), one line per (piece, shape, M)."""
    def us(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) else "—"

    out = ["| piece | switch | shape | M | fused us | chain us | other baselines us | floor us | chain / fused "
           "| saved us / step | fused err |",
           "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if not r.get("ok"):
            out.append(f"| {r['piece']} | {r['switch']} | {r['shape']} | {r['M']} | FAILED: {r.get('error', '?')[:80]} "
                       "| | | | | | |")
            continue
        ratio = f"{r['chain_over_fused']:.2f}" if "chain_over_fused" in r else "—"
        saved = f"{r['saved_us_per_step']:.1f}" if "saved_us_per_step" in r else "—"
        others = ", ".join(f"{k[4:-3]} {us(v)}" for k, v in r.items() if k.startswith("alt:") and k.endswith("_us"))
        out.append(f"| {r['piece']} | {r['switch']} | {r['shape']} | {r['M']} | {us(r.get('fused_us'))} "
                   f"| {us(r.get('chain_us'))} | {others or '—'} | {us(r.get('floor_us'))} | {ratio} "
                   f"| {saved} | {r['errors']['fused']:.1e} |")
    return "\n".join(out)


def predicted_savings(rows: list[dict[str, Any]], M: int) -> dict[str, float]:
    """us a decode step at M tokens saves per switch, summed over its pieces (the cache-writing
    variant of a piece counted instead of the plain one where both were timed)."""
    by_piece = {r["piece"]: r for r in rows if r.get("ok") and r["M"] == M and "saved_us_per_step" in r}
    if "qk_norm_rope_cache" in by_piece:
        by_piece.pop("qk_norm_rope", None)
    out: dict[str, float] = {}
    for r in by_piece.values():
        out[r["switch"]] = out.get(r["switch"], 0.0) + r["saved_us_per_step"]
    return out
