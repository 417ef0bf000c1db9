"""Ratios between benchmark variants with their 95 % interval over processes.

The process (one server or engine start) is the unit: the spread between processes, not the one
inside a process, sets the interval. A ratio is the ratio of geometric means; its interval is
Welch's t interval on the difference of mean logs (scipy.stats.ttest_ind, unequal variances),
exponentiated.
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
