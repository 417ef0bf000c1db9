"""Fixed-batch decode A/B over many processes: the spread that matters is between processes.

    python bench/decode_ab.py --model mixtral-8x7b-tp8-rank --quantization fp8-static \
        --variants stock,vllm-triton,moe-serve --processes 6 --out runs/dab
    python bench/decode_ab.py ... --out runs/dab       # same command again: resumes, skips runs done
    python bench/decode_stats.py runs/dab               # ratios vs the first variant, 95 % CIs

Round r runs every variant once, one `bench/decode_probe.py` process each, in the order
rotated by r (so every variant takes every position equally often). Each process writes
run-r<r>-<variant>.json and its log; a finished run is never repeated, so an interrupted A/B
continues where it stopped when the same command runs again. With `--budget-s` it starts no
process the budget cannot hold: the longer of this variant's last two processes on this host
(the run files record host and end time; a variant's first process on a machine compiles and
is slow), or `--expect-run-s` for a variant not yet run here. The MoE backend vLLM picked is read from each
process's log (its "Using ... MoE backend" line) into the run file. With `--profile`, the next
process of each variant that has no profiled run in --out also profiles after its timed runs
(decode_probe.py --profile).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import decode_probe, decode_stats  # noqa: E402
from bench.dummy_model import dummy_model_dir  # noqa: E402

BACKEND_LINE = re.compile(r"Using .*MoE backend.*|.*[Ss]elect.*MoE backend.*")
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[decode_ab +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def rounds(variants: list[str], processes: int) -> list[tuple[int, str]]:
    """(round, variant) in run order: round r is the variant list rotated left by r."""
    k = len(variants)
    return [(r, variants[(r + i) % k]) for r in range(processes) for i in range(k)]


def run_one(model: Path, variant: str, rnd: int, a: argparse.Namespace, profile: bool = False) -> float:
    """One probe process; returns its wall seconds. Raises on failure (log kept)."""
    out = a.out / f"run-r{rnd}-{variant}.json"
    logf = a.out / f"run-r{rnd}-{variant}.log"
    cmd = [sys.executable, str(ROOT / "bench" / "decode_probe.py"), "--model", str(model),
           "--variant", variant, *decode_probe.workload_argv(a), "--out", str(out)] \
        + (["--profile"] if profile else [])
    t0 = time.monotonic()
    with logf.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=a.probe_timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"probe {variant} r{rnd} exited {proc.returncode}; see {logf}")
    res = json.loads(out.read_text())
    res.update(round=rnd, wall_s=wall, host=socket.gethostname(), ended=time.time(),
               moe_backend_log=sorted(set(BACKEND_LINE.findall(logf.read_text())))[:4])
    out.write_text(json.dumps(res, indent=1))
    return wall


def profiled(out: Path) -> set[str]:
    """Variants with a profiled run in `out`."""
    runs = [json.loads(p.read_text()) for p in out.glob("run-r*-*.json")]
    return {r["variant"] for r in runs if r.get("profile")}


def expected_walls(out: Path) -> dict[str, float]:
    """variant -> the longer wall seconds of its last two runs in `out` made on this host."""
    walls: dict[str, list[tuple[float, float]]] = {}
    for p in out.glob("run-r*-*.json"):
        r = json.loads(p.read_text())
        if r.get("host") == socket.gethostname() and "ended" in r:
            walls.setdefault(r["variant"], []).append((r["ended"], r["wall_s"]))
    return {v: max(w for _, w in sorted(ws)[-2:]) for v, ws in walls.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mixtral-8x7b-tp8-rank",
                   help="bench/models/<name> (dummy weights), or a model directory")
    p.add_argument("--quantization", choices=["none", "fp8-static"], default="none")
    p.add_argument("--variants", default="stock,moe-serve", help="first = the baseline")
    p.add_argument("--processes", type=int, default=6, help="processes (rounds) per variant")
    decode_probe.add_workload_args(p)     # forwarded to every probe process
    p.add_argument("--profile", action="store_true",
                   help="profile one process per variant (after its timed runs), if none is yet")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds: start no process that would end after this (default: run all)")
    p.add_argument("--probe-timeout-s", type=float, default=300.0)
    p.add_argument("--expect-run-s", type=float, default=60.0,
                   help="seconds a variant's process is assumed to take until one has run on "
                        "this host (a cold machine's first engine start compiles: minutes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()            # the budget counts from this call, not from the import
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    other = {decode_stats.workload(r) for r in decode_stats.load_runs([a.out])} - {(a.prompts, a.temperature)}
    if other:
        log(f"runs in {a.out} decoded another workload {sorted(other)} (prompts, temperature); "
            f"this command's is {(a.prompts, a.temperature)}: use another --out")
        return 2
    quant = None if a.quantization == "none" else a.quantization
    model = Path(a.model) if Path(a.model).is_dir() and quant is None else \
        dummy_model_dir(a.model, a.out, quantization=quant)
    plan = rounds(a.variants.split(","), a.processes)
    todo = [(r, v) for r, v in plan if not (a.out / f"run-r{r}-{v}.json").is_file()]
    log(f"{len(plan) - len(todo)} of {len(plan)} runs done; model {model}")
    expect = expected_walls(a.out)
    for i, (r, v) in enumerate(todo):
        left = None if a.budget_s is None else a.budget_s - (time.monotonic() - started)
        need = expect.get(v, a.expect_run_s)
        if left is not None and left < need:
            log(f"budget: {left:.0f} s left < {need:.0f} s per run; stopping "
                f"with {len(todo) - i} runs to go (run the same command to resume)")
            return 3
        log(f"run {i + 1}/{len(todo)}: round {r} {v}")
        try:
            wall = run_one(model, v, r, a, profile=a.profile and v not in profiled(a.out))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"FAILED: {e}")
            return 1
        expect = expected_walls(a.out)
        log(f"round {r} {v} done in {wall:.0f} s")
    log("all runs done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
