"""Statistics of a fixed-batch decode A/B (bench/decode_ab.py): ratio to the baseline with a CI.

    python bench/decode_stats.py DIR [DIR...] [--baseline stock]   # markdown table on stdout

Per variant and batch size B, each process contributes one output tok/s (the median of its
repetitions). The ratio to the baseline is the ratio of geometric means over processes; its
95 % confidence interval is Welch's t interval on the difference of mean log tok/s
(scipy.stats.ttest_ind, unequal variances), exponentiated. The process is the unit: the
spread between processes, not the one inside a process, sets the interval. "all B" is the same
on each process's geometric mean over its batch sizes.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any


def workload(run: dict[str, Any]) -> tuple[str, float]:
    """(prompts, temperature) the probe decoded; runs written before the probe had the options
    decoded B copies of one prompt greedily."""
    return run.get("prompts", "same"), float(run.get("temperature", 0.0))


def load_runs(dirs: list[Path]) -> list[dict[str, Any]]:
    """Every run-r*-*.json with measured rows under the given directories; refuses to pool runs
    of different workloads."""
    runs = []
    for d in dirs:
        for p in sorted(d.glob("run-r*-*.json")):
            r = json.loads(p.read_text())
            if r.get("rows"):
                runs.append(r)
    kinds = {workload(r) for r in runs}
    if len(kinds) > 1:
        raise SystemExit(f"runs of different workloads (prompts, temperature) {sorted(kinds)} in "
                         f"{', '.join(map(str, dirs))}: compare them separately")
    return runs


def per_process(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """variant -> B (as str, plus 'all') -> [tok/s of each process]."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        cells = out.setdefault(r["variant"], {})
        toks = {str(row["B"]): row["tok_s"] for row in r["rows"]}
        for b, t in toks.items():
            cells.setdefault(b, []).append(t)
        cells.setdefault("all", []).append(statistics.geometric_mean(toks.values()))
    return out


def _cv(xs: list[float]) -> float | None:
    """Coefficient of variation over processes (None for one process)."""
    return statistics.stdev(xs) / statistics.fmean(xs) if len(xs) > 1 else None


def ratio_ci(v: list[float], base: list[float]) -> dict[str, float | int | None]:
    """Geomean ratio v/base and its 95 % Welch interval on logs (None with < 2 per side)."""
    lv, lb = [math.log(x) for x in v], [math.log(x) for x in base]
    res: dict[str, float | int | None] = {"n": len(v), "n_base": len(base),
                                          "ratio": math.exp(statistics.fmean(lv) - statistics.fmean(lb)),
                                          "lo": None, "hi": None,
                                          "cv": _cv(v), "cv_base": _cv(base)}
    if len(v) >= 2 and len(base) >= 2:
        from scipy import stats      # lazily: decode_ab.py needs only load_runs and workload

        ci = stats.ttest_ind(lv, lb, equal_var=False).confidence_interval(0.95)
        res["lo"], res["hi"] = math.exp(ci.low), math.exp(ci.high)
    return res


def summarize(runs: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One row per (variant != baseline, B): tok/s means, ratio, CI, process counts."""
    pp = per_process(runs)
    if baseline not in pp:
        raise SystemExit(f"baseline {baseline!r} has no runs; variants: {sorted(pp)}")
    rows = []
    for variant, cells in sorted(pp.items()):
        if variant == baseline:
            continue
        for b in sorted(cells, key=lambda s: (s == "all", int(s) if s.isdigit() else 0)):
            if b in pp[baseline]:
                rows.append({"variant": variant, "B": b, "tok_s": statistics.fmean(cells[b]),
                             "base_tok_s": statistics.fmean(pp[baseline][b]),
                             **ratio_ci(cells[b], pp[baseline][b])})
    return rows


def markdown(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    f = (lambda x, p=3: "n/a" if x is None else f"{x:.{p}f}")
    out = [f"| variant | B | n / n_{baseline} | tok/s | {baseline} tok/s | ratio | 95 % CI | CV | CV {baseline} |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['variant']} | {r['B']} | {r['n']} / {r['n_base']} | {r['tok_s']:.0f} | "
                   f"{r['base_tok_s']:.0f} | {r['ratio']:.3f} | [{f(r['lo'])}, {f(r['hi'])}] | "
                   f"{f(r['cv'])} | {f(r['cv_base'])} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--baseline", default="stock")
    a = ap.parse_args(argv)
    runs = load_runs(a.dirs)
    if not runs:
        print(f"no runs under {', '.join(map(str, a.dirs))}", file=sys.stderr)
        return 1
    print("\n".join(markdown(summarize(runs, a.baseline), a.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
