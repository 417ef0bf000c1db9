"""Soak: the `mixed` scenario at saturation for a long time; errors, API-process RSS growth, p99 drift.

Not in CI. Starts the server itself (embedded model unless --model), samples the API process's
RSS every --sample-s, drives `loadtest run --scenario mixed` with Locust (or --engine asyncio),
then prints and writes `soak.json` (from the per-request records both engines write) and the
RSS time series `rss.csv`. On >= 2 cores the server gets its own core
(loadtest/server_proc.server_core_isolation):

    .venv/bin/python bench/soak.py --minutes 30 --users 16 --out /tmp/soak
Pass/fail: errors == 0, RSS growth (after the first --warmup-min) < 5 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.server_proc import MODEL_NAME, start_server  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def p99(values: list[float]) -> float | None:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 100 else (max(values) if values else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--warmup-min", type=float, default=5)
    p.add_argument("--sample-s", type=float, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--engine", choices=("locust", "asyncio"), default="locust")
    p.add_argument("--server-arg", action="append", default=[])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_server(args.out, *args.server_arg)
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    began = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic() - began, rss_mib(server.proc.pid)))
            stop.wait(args.sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        cmd = [sys.executable, "-m", "loadtest", "run", "--scenario", "mixed", "--engine", args.engine,
               "--host", server.base_url, "--model", MODEL_NAME, "--max-users", str(args.users),
               "--step-seconds", str(args.minutes * 60 / 3), "--no-plots", "--out", str(args.out / "load")]
        rc = subprocess.run(cmd, cwd=REPO).returncode
    finally:
        stop.set()
        sampler.join()
        server.stop()
    records = [json.loads(line) for line in (args.out / "load" / "requests.jsonl").read_text().splitlines()]
    errors = [r for r in records if r["status"] == "error"]
    t0 = min(r["t_start"] for r in records)
    window = args.warmup_min * 60
    first = [r["ttft"] for r in records if r["ttft"] is not None and r["t_start"] - t0 < window]
    last = [r["ttft"] for r in records if r["ttft"] is not None and r["t_start"] - t0 > args.minutes * 60 - window]
    base = next(m for t, m in samples if t >= window) if any(t >= window for t, _ in samples) else samples[0][1]
    summary = {
        "minutes": args.minutes, "users": args.users, "engine": args.engine, "loadtest_rc": rc, "requests": len(records),
        "ok": sum(r["status"] == "ok" for r in records), "errors": len(errors),
        "first_errors": [e["error"] for e in errors[:5]],
        "rss_mib_after_warmup": round(base, 1), "rss_mib_end": round(samples[-1][1], 1),
        "rss_growth_pct": round(100 * (samples[-1][1] - base) / base, 2), "rss_max_mib": round(max(m for _, m in samples), 1),
        "ttft_p99_first_window_s": p99(first), "ttft_p99_last_window_s": p99(last),
        "output_tokens": sum(r["output_tokens"] for r in records),
    }
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2))
    (args.out / "rss.csv").write_text("seconds,rss_mib\n" + "".join(f"{t:.1f},{m:.1f}\n" for t, m in samples))
    print(json.dumps(summary, indent=2))
    return 0 if summary["errors"] == 0 and summary["rss_growth_pct"] < 5 else 1


if __name__ == "__main__":
    sys.exit(main())
