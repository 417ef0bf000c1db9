"""Where does the API process's memory grow? memray (native stacks) over a window of load.

    .venv/bin/pip install memray==1.20.0                      # a diagnostic tool, not a dependency
    .venv/bin/python bench/investigations/native_leak_probe.py --out /tmp/leak --seconds 240   # ~6 min on the CPU engine

Starts the server (embedded model, its own core) with this file as a wrapper ($CAPTURE_ENV set:
`python -m service` with the same arguments in the same process): SIGUSR1 starts a
memray Tracker (native traces) in the server process, a second SIGUSR1 stops it. The driver warms
the server up with the `mixed` scenario, tracks one more `--seconds` of it, then lists the
allocations made in the window and still alive at its end, grouped by stack, largest first
(`leaked_top.txt`). tracemalloc cannot see these: they are made by native code (Rust, C).
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CAPTURE_ENV = "MOE_SERVE_LEAK_PROBE_CAPTURE"


def serve(capture: Path) -> None:
    """Wrapper mode (in the server process): `python -m service` with SIGUSR1 = start/stop memray."""
    import memray

    tracker: list = []

    def toggle(*_: object) -> None:
        if not tracker:
            capture.unlink(missing_ok=True)
            tracker.append(memray.Tracker(str(capture), native_traces=True))
            tracker[0].__enter__()
            print("[native_leak_probe] memray tracking on", flush=True)
        else:
            tracker.pop().__exit__(None, None, None)
            print("[native_leak_probe] memray tracking off", flush=True)

    signal.signal(signal.SIGUSR1, toggle)
    sys.argv = ["service", *sys.argv[1:]]
    runpy.run_module("service", run_name="__main__", alter_sys=True)


def top_leaks(capture: Path, rows: int = 8, depth: int = 14) -> str:
    """Allocations alive at the end of the window, grouped by (hybrid Python/native) stack."""
    import memray

    recs = list(memray.FileReader(str(capture)).get_leaked_allocation_records(merge_threads=True))
    size: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for rec in recs:
        stack = tuple(f"{fn} {str(path).split('/')[-1]}:{line}" for fn, path, line in rec.hybrid_stack_trace(max_stacks=depth))
        size[stack] += rec.size
        count[stack] += rec.n_allocations
    out = [f"alive at the end of the window: {sum(r.size for r in recs)} bytes in {len(recs)} records"]
    for stack, n in size.most_common(rows):
        out.append(f"\n== {n / 1024:.1f} KiB in {count[stack]} allocations")
        out += [f"    {frame[:160]}" for frame in stack]
    return "\n".join(out)


def main() -> int:
    if os.environ.get(CAPTURE_ENV):
        serve(Path(os.environ[CAPTURE_ENV]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=240, help="tracked load")
    p.add_argument("--warmup-seconds", type=float, default=60)
    p.add_argument("--users", type=int, default=16)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from loadtest.server_proc import MODEL_NAME, start_server

    capture = (a.out / "window.bin").resolve()
    server = start_server(a.out, env={CAPTURE_ENV: str(capture)}, module="bench.investigations.native_leak_probe",
                          log_name="server.log", ready_timeout=400)

    def load(seconds: float, tag: str) -> int:
        cmd = [sys.executable, "-m", "loadtest", "run", "--scenario", "mixed", "--engine", "asyncio",
               "--host", server.base_url, "--model", MODEL_NAME, "--max-users", str(a.users),
               "--step-seconds", str(seconds / 3), "--no-plots", "--out", str(a.out / tag)]
        subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, check=True)
        return sum(1 for _ in open(a.out / tag / "requests.jsonl"))

    try:
        print(f"warm-up: {load(a.warmup_seconds, 'warm')} requests", flush=True)
        os.kill(server.proc.pid, signal.SIGUSR1)
        time.sleep(2)
        print(f"tracked: {load(a.seconds, 'tracked')} requests", flush=True)
        time.sleep(5)  # let the last responses finish
        os.kill(server.proc.pid, signal.SIGUSR1)
        time.sleep(10)  # the tracker writes its file
    finally:
        server.stop()
    report = top_leaks(capture)
    (a.out / "leaked_top.txt").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
