"""Per-stage numbers from per-request records (the report's single source of truth).

Latency columns use requests *started* in the stage that finished ok. Output tok/s counts
the tokens generated inside the stage's time window (tokens spread evenly between a
request's first and last content chunk; cancelled requests count too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moe_serve.loadtest.records import Record
from moe_serve.loadtest.scenarios import Stage


def percentile(values: list[float], p: float) -> float | None:
    """Locust's percentile definition: sorted(values)[int(n * p)] (clamped)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(int(len(s) * p), len(s) - 1)]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def tokens_in_window(r: Record, a: float, b: float) -> float:
    """Output tokens of `r` produced in [a, b), assuming evenly spaced tokens from first to last chunk."""
    n = r.output_tokens
    if n <= 0 or r.t_first is None:
        return 0.0
    first, last = r.t_first, r.t_last if r.t_last is not None else r.t_first
    if n == 1 or last <= first:
        return float(a <= first < b)
    gap = (last - first) / (n - 1)
    lo = max(0, math.ceil((a - first) / gap))  # first token index with time >= a
    hi = min(n - 1, math.ceil((b - first) / gap) - 1)  # last index with time < b
    return float(max(0, hi - lo + 1))


@dataclass
class StageStats:
    stage: int
    label: str
    users: int
    seconds: float
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    itl_mean_ms: float | None
    e2e_p50_ms: float | None
    e2e_mean_ms: float | None
    output_tokens: int
    output_tok_s: float
    req_s: float


def stage_stats(i: int, stage: Stage, records: list[Record]) -> StageStats:
    """Numbers of stage `i` (records of the whole run are given; each is attributed by start time)."""
    mine = [r for r in records if r.stage == i]
    ok = [r for r in mine if r.status == "ok"]
    ms = lambda attr: [getattr(r, attr) * 1000.0 for r in ok if getattr(r, attr) is not None]  # noqa: E731
    ttft, itl, e2e = ms("ttft"), ms("itl"), ms("e2e")
    window_tokens = sum(tokens_in_window(r, stage.start, stage.end) for r in records)
    secs = stage.seconds
    return StageStats(
        stage=i, label=stage.label, users=stage.users, seconds=secs, requests=len(ok),
        errors=sum(r.status == "error" for r in mine),
        ttft_p50_ms=percentile(ttft, 0.5), ttft_p90_ms=percentile(ttft, 0.9), ttft_p99_ms=percentile(ttft, 0.99),
        ttft_mean_ms=mean(ttft), itl_p50_ms=percentile(itl, 0.5), itl_p99_ms=percentile(itl, 0.99),
        itl_mean_ms=mean(itl), e2e_p50_ms=percentile(e2e, 0.5), e2e_mean_ms=mean(e2e),
        output_tokens=sum(r.output_tokens for r in ok),
        output_tok_s=window_tokens / secs if secs > 0 else 0.0, req_s=len(ok) / secs if secs > 0 else 0.0)


def all_stages(stages: list[Stage], records: list[Record]) -> list[dict]:
    """Stage stats as plain dicts, in stage order."""
    return [asdict(stage_stats(i, st, records)) for i, st in enumerate(stages)]


def error_samples(records: list[Record], limit: int = 5) -> list[str]:
    """A few distinct error messages, for the report."""
    seen: list[str] = []
    for r in records:
        if r.status == "error" and r.error and r.error not in seen:
            seen.append(r.error)
    return seen[:limit]
