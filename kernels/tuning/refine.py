"""Refine a tuned table: walk each bucket's config through named search phases only.

A new kernel dimension (e.g. the decode path's L2 prefetch) is tried on a table that a full
search (moe_serve.kernels.tuning.tune) already made, in a minute instead of that search's budget: per
bucket, the table's config is timed, then each named phase of its family builds candidates from
the best so far (moe_serve.kernels.tuning.tune.PHASES), and a candidate replaces it only when faster by
more than MIN_GAIN. A config never gets slower than the table's by more than the timing spread.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from moe_serve.kernels.moe import configs
from moe_serve.kernels.moe.config_schema import Config, label
from moe_serve.kernels.tuning import candidates, precompile, tune
from moe_serve.kernels.tuning.timing import make_problem

MIN_GAIN = 0.01             # a candidate must beat the current config by more than this share


def phase_names() -> list[str]:
    return [name for name, _, _ in tune.PHASES]


def refine_table(E: int, N: int, K: int, topk: int, dtype: str, table: dict[int, Config],
                 phases: list[str], buckets: tuple[int, ...], budget_s: float,
                 device: str = "cuda", log: Callable[[str], None] = print
                 ) -> tuple[dict[int, Config], dict[int, dict[str, Any]]]:
    """(the table with its buckets in `buckets` refined, {bucket: {"before_us", "after_us",
    "before", "after"}} for those timed). Buckets past the budget keep their config."""
    known = {name: (fam, make) for name, fam, make in tune.PHASES}
    unknown = [p for p in phases if p not in known]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; phases: {phase_names()}")
    t0 = time.perf_counter()
    dev = "cuda" if device.startswith("cuda") else "cpu"
    shape = {"E": E, "N": N, "K": K, "topk": topk, "dtype": dtype}
    out, report = dict(table), {}
    weights = None

    for b in (b for b in sorted(table) if b in buckets):
        if time.perf_counter() - t0 > budget_s:
            log(f"  refine: budget spent before bucket {b}")
            break
        prob = make_problem(E, N, K, topk, b, dtype, n_sets=8, device=dev, seed=b, weights=weights)
        weights = prob["weights"]
        cur = table[b]
        t_cur = t_before = tune.time_candidate(shape, b, cur, prob, log)
        for name in phases:
            fam, make = known[name]
            if tune.family(cur) != fam:
                continue
            cands = candidates.legal_unique(make(cur, shape), [cur], N, K, topk, dtype)
            if dev == "cuda":
                precompile.precompile([(E, N, K, topk, dtype, b, c) for c in cands], log=log)
            for c in cands:
                t = tune.time_candidate(shape, b, c, prob, log)
                if t < t_cur * (1 - MIN_GAIN):
                    cur, t_cur = c, t
        out[b] = configs.fit(cur, dtype, topk=topk)
        report[b] = {"before_us": round(t_before, 2), "after_us": round(t_cur, 2),
                     "before": label(table[b]), "after": label(out[b])}
        log(f"  M={b}: {t_before:.1f} -> {t_cur:.1f} us ({label(out[b])})")
        del prob
    return out, report
