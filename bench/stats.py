"""Ratios between benchmark variants with their 95 % interval over processes.

The process (one server or engine start) is the unit: the spread between processes, not the one
inside a process, sets the interval. A ratio is the ratio of geometric means; its interval is
Welch's t interval on the difference of mean logs (scipy.stats.ttest_ind, unequal variances),
exponentiated. An interval wider than WIDE asks for more processes (bench/serve/schedule.py), and
a process whose value lies outside the spread of its variant's other processes is flagged
(`outlier`), so a table can show its cell with and without it.
"""
from __future__ import annotations

import math
import statistics


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
        from scipy import stats      # the bench extra: only where an interval is computed

        ci = stats.ttest_ind(lv, lb, equal_var=False).confidence_interval(0.95)
        res["lo"], res["hi"] = math.exp(ci.low), math.exp(ci.high)
    return res


WIDE = 0.02             # an interval wider than this (hi / lo - 1) needs more processes
SPREAD_FLOOR = 0.02     # a process within this of the others is never flagged


def wider_than(r: dict[str, float | int | None], width: float = WIDE) -> bool:
    """The 95 % interval of ratio_ci's `r` spans more than `width` (hi / lo - 1); no interval: True."""
    return r["lo"] is None or r["hi"] / r["lo"] - 1 > width


def outlier(xs: list[float], floor: float = SPREAD_FLOOR) -> int | None:
    """The index of the process outside the others' spread, if one is: with 3 or more positive
    values, compared on logs, one whose distance to the nearest other value exceeds both twice the
    others' range and log(1 + floor) (the farthest such); None where none is."""
    if len(xs) < 3:
        return None
    logs = [math.log(x) for x in xs]
    best, best_gap = None, math.log1p(floor)
    for i, x in enumerate(logs):
        others = logs[:i] + logs[i + 1:]
        gap = min(abs(x - o) for o in others)
        if gap > 2 * (max(others) - min(others)) and gap > best_gap:
            best, best_gap = i, gap
    return best
