"""Processes outside their variant's spread, and the ratios without them.

Per level c, variant and primary metric (ITL p50, output tok/s), the cells of the variant's
processes are checked with moe_serve.bench.stats.outlier (3 or more processes; one whose value lies farther
from the nearest other than both twice the others' range and 2 %). A flagged process is named
with its value and the others' range, and each ratio it enters (its variant's against the
baseline, or every variant's where it is a baseline process) is given with and without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.stats import outlier

METRICS = {"itl_p50_ms": "itl_speedup", "tok_s": "tok_s_ratio"}   # cell value -> the ratio it enters


@dataclass(frozen=True)
class Flag:
    """One process outside its variant's spread at one level and metric."""

    level: int
    variant: str
    round: int
    dir: Path
    metric: str                       # a METRICS key
    value: float
    others: tuple[float, float]       # the other processes' lowest and highest value


def flags(procs: list[serve_stats.Process]) -> list[Flag]:
    """Every flagged process of one model's processes, by level, variant and metric."""
    out = []
    for c in procs[0].meta["workload"]["levels"]:
        for v in sorted({p.variant for p in procs}):
            ok = [p for p in procs if p.variant == v and not p.cells[c]["errors"]]
            for metric in METRICS:
                values = [p.cells[c][metric] for p in ok]
                i = outlier(values)
                if i is not None:
                    rest = values[:i] + values[i + 1:]
                    out.append(Flag(c, v, ok[i].meta["round"], ok[i].dir, metric, values[i], (min(rest), max(rest))))
    return out


def with_and_without(procs: list[serve_stats.Process], flag: Flag, baseline: str,
                     variants: tuple[str, ...]) -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """(variant, ratio with the flagged process, ratio without it) for each ratio it enters at its
    level (moe_serve.bench.stats.ratio_ci; without: None where no ratio is left)."""
    key = METRICS[flag.metric]
    rows = [r for r in serve_stats.pooled_rows(procs, baseline, variants) if r["level"] == flag.level]
    kept = [p for p in procs if p.dir != flag.dir]
    after = {r["variant"]: r for r in serve_stats.pooled_rows(kept, baseline, variants) if r["level"] == flag.level}
    return [(r["variant"], r[key], after.get(r["variant"], {}).get(key)) for r in rows
            if key in r and (flag.variant == baseline or r["variant"] == flag.variant)]
