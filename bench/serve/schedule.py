"""The yardstick's schedule: which server process runs in which round, and how many requests each
load level sends (warm-up and timed)."""
from __future__ import annotations

from bench.serve.servers import FRONTEND


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
    """Timed requests at c: per_level if given, else max(WAVES x c, 32). A level's output tok/s
    is its tokens over its wall time, whose first and last waves ramp up and drain; with 4 waves
    (c = 8, 32 requests) those ramps left a 3 + 3 process interval of [0.83, 1.44]."""
    return per_level if per_level else max(WAVES * c, 32)
