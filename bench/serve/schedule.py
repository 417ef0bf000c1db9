"""The yardstick's schedule: which server process runs in which round, how many requests each
load level sends (warm-up and timed), and when a run needs more rounds.

A headline cell (bench/serve/render.py) needs MIN_PROCESSES + MIN_PROCESSES alternating processes,
WIDE_PROCESSES each where its interval is wider than moe_serve.bench.stats.WIDE, and at c >= BATCHED at least
MIN_BATCHED_REQUESTS timed requests per process; `more_rounds` tells the yardstick to add a round
while a primary cell misses that.
"""
from __future__ import annotations

from typing import Any

from moe_serve.bench.serve.servers import FRONTEND
from moe_serve.bench.stats import wider_than

MIN_PROCESSES, WIDE_PROCESSES = 3, 4
BATCHED, MIN_BATCHED_REQUESTS = 8, 256
PRIMARY = ((1, "itl_speedup"), (8, "tok_s_ratio"))   # (c, ratio): c = 1 ITL p50, c = 8 output tok/s


def round_order(variants: list[str], r: int) -> list[str]:
    """Round r's order: rotated left by r; with an odd count, reversed in every second cycle."""
    n = len(variants)
    order = variants[r % n:] + variants[:r % n]
    return order[::-1] if n % 2 == 1 and n > 1 and (r // n) % 2 == 1 else order


def plan(variants: list[str], processes: int, frontend_every: int) -> list[tuple[int, str]]:
    """(round, variant) in run order; the frontend variant only in rounds r % frontend_every == 0."""
    return [(r, v) for r in range(processes) for v in round_order(variants, r)
            if v != FRONTEND or r % frontend_every == 0]


def warmup_count(c: int) -> int:
    """At least 4 warm-up requests, a whole number of waves of c."""
    return c * -(-4 // c)


def warmup_pass_count(c: int) -> int:
    """Requests per level of the warm-up pass: at least 16, two waves of c or more."""
    return c * max(2, -(-16 // c))


WAVES = 16   # default requests per level: c in flight this many times over (at least 32)


def requests_at(c: int, per_level: int | None) -> int:
    """Timed requests at c: per_level if given, else max(WAVES x c, 32), and at c >= BATCHED at
    least MIN_BATCHED_REQUESTS. A level's output tok/s is its tokens over its wall time, whose
    first and last waves ramp up and drain; with 4 waves (c = 8, 32 requests) those ramps left a
    3 + 3 process interval of [0.83, 1.44]."""
    if per_level:
        return per_level
    return max(WAVES * c, MIN_BATCHED_REQUESTS if c >= BATCHED else 32)


def processes_needed(ratio: dict[str, Any]) -> int:
    """Processes per side a headline cell with this ratio (moe_serve.bench.stats.ratio_ci) needs."""
    return WIDE_PROCESSES if wider_than(ratio) else MIN_PROCESSES


def more_rounds(rows: list[dict[str, Any]]) -> list[str]:
    """The primary cells (pooled rows of moe_serve.bench.serve.stats) short of processes for their interval,
    as "c = 1 moe-serve: 3 + 3, interval [..] needs 4 + 4"; [] where none is. The frontend
    variant, which runs in every K-th round only, is not counted."""
    short = []
    for r in rows:
        if r["variant"] == FRONTEND:
            continue
        for c, key in PRIMARY:
            ratio = r.get(key)
            if r["level"] != c or not ratio:
                continue
            need = processes_needed(ratio)
            if min(ratio["n"], ratio["n_base"]) < need:
                interval = "no interval" if ratio["lo"] is None else f"[{ratio['lo']:.3f}, {ratio['hi']:.3f}]"
                short.append(f"c = {c} {r['variant']}: {ratio['n']} + {ratio['n_base']}, {interval} needs "
                             f"{need} + {need}")
    return short
