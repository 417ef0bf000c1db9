"""Where a served decode step goes: vLLM's torch profiler around bursts of c requests over HTTP.

The server runs with vLLM's profiler configured (serve_servers.profiler_config: torch, engine
side only, gzip traces into the process's traces/ dir); `/start_profile` and `/stop_profile` (both
servers have them then) bracket one burst of c requests of `short` output tokens and one of
`long`. As in bench/decode_profile.py, long minus short over (long - short) tokens cancels the
prefill and per-request costs: per decode step, the time of each kernel class
(decode_profile.kernel_class), GPU busy, and the measured step (the process's unprofiled ITL p50
at c) minus busy = GPU idle. Each trace is summarized (per-kernel count and total us,
trace.summarize_trace), averaged over the TP ranks' traces, kept in profile.json, and
deleted unless a keep dir is given.
"""
from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from moe_serve.bench.serve import trace
from moe_serve.bench.serve.load import LoadClient

TRACE_GLOB = "*.pt.trace.json*"


def traces(trace_dir: Path) -> set[Path]:
    return set(trace_dir.rglob(TRACE_GLOB))


async def new_traces(trace_dir: Path, before: set[Path], timeout_s: float) -> list[Path]:
    """The traces written since `before`, once at least one exists and none grew for a second."""
    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, int] = {}
    while time.monotonic() < deadline:
        now = {p: p.stat().st_size for p in traces(trace_dir) - before}
        if now and now == sizes:
            return sorted(now)
        sizes = now
        await asyncio.sleep(1.0)
    raise TimeoutError(f"no complete new trace in {trace_dir} within {timeout_s:.0f} s (have {sorted(sizes)})")


def mean_over_ranks(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's view from every rank's trace summary: counts, times and busy averaged."""
    n = len(summaries)
    kernels: dict[str, list[float]] = {}
    for s in summaries:
        for name, (count, us) in s["kernels"].items():
            k = kernels.setdefault(name, [0.0, 0.0])
            k[0] += count / n
            k[1] += us / n
    return {"kernels": kernels, "ranks": n,
            **{key: sum(s[key] for s in summaries) / n for key in ("busy_us", "span_us", "cpu_ops")}}


async def capture(client: LoadClient, stage: int, c: int, tokens: tuple[int, int], trace_dir: Path,
                  keep: Path | None, timeout_s: float = 180.0) -> dict[str, Any]:
    """{"tokens": [short, long], "wall_s": {...}, "short": summary, "long": summary} for c streams."""
    out: dict[str, Any] = {"tokens": list(tokens), "wall_s": {}}
    for name, n in zip(("short", "long"), tokens):
        before = traces(trace_dir)
        if (code := await client.post("/start_profile")) != 200:
            raise RuntimeError(f"/start_profile answered {code}")
        try:
            wall, recs = await client.burst(stage, c, n, f"profile-{name}")
        finally:
            await client.post("/stop_profile")
        bad = [r.error for r in recs if r.status != "ok"]
        if bad:
            raise RuntimeError(f"{len(bad)} of {c} profiled requests failed: {bad[0]}")
        written = await new_traces(trace_dir, before, timeout_s)
        out["wall_s"][name] = wall
        out[name] = mean_over_ranks([trace.summarize_trace(p) for p in written])
        for i, p in enumerate(written):
            if keep is None:
                p.unlink()
            else:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.move(p, keep / (f"c{c}-{name}-{i}.pt.trace.json" + (".gz" if p.suffix == ".gz" else "")))
    return out

