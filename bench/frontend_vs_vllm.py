"""Our HTTP frontend vs vLLM's own OpenAI server, same engine, same tiny model, same run.

Starts `python -m vllm.entrypoints.openai.api_server` on the embedded model (vLLM CPU engine),
drives it with the closed-loop streaming `step` sweep (`loadtest run --engine asyncio`;
concurrency 1, 2, 4, ..., --max-users), stops it, does the same with `python -m service`, then
repeats that in alternating order and prints, per concurrency, the median over repetitions of each
server's metrics and their ratio (ours/vLLM). On >= 2 cores each server gets the last core and the
load client the rest (loadtest/server_proc.server_core_isolation). Usage (CPU, ~6 min per repetition):

    .venv/bin/python bench/frontend_vs_vllm.py --out /tmp/frontend --max-users 64 --step-seconds 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.ab import RATIO_KEYS, write_ab  # noqa: E402
from service.embedded_model import ensure_embedded_model  # noqa: E402
from loadtest.server_proc import MODEL_NAME, ServerProcess, start_server  # noqa: E402

VLLM, OURS = "vllm-api-server", "moe-serve"


def start_vllm_api_server(out: Path, model_dir: Path, ready_timeout: float) -> ServerProcess:
    """vLLM's own OpenAI server on the same model, name and KV budget as ours (same launcher, same core)."""
    return start_server(out, "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                        "--kv-cache-memory-bytes", str(512 * 1024 ** 2), "--no-enable-log-requests",
                        module="vllm.entrypoints.openai.api_server", log_name=f"{VLLM}.log",
                        ready_timeout=ready_timeout)


def sweep(url: str, label: str, out: Path, args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "loadtest", "run", "--engine", "asyncio", "--scenario", "step", "--host", url,
           "--label", label, "--model", MODEL_NAME, "--max-users", str(args.max_users),
           "--step-seconds", str(args.step_seconds), "--max-tokens", str(args.max_tokens), "--no-plots",
           "--out", str(out / label)]
    return subprocess.run(cmd, cwd=REPO).returncode


def run_one(label: str, out: Path, model_dir: Path, args: argparse.Namespace) -> float:
    """Start one server, sweep it into out/label, stop it; returns its start-up seconds."""
    began = time.monotonic()
    if label == VLLM:
        server = start_vllm_api_server(out, model_dir, args.ready_timeout)
    else:
        server = start_server(out, ready_timeout=args.ready_timeout)
    ready_s = time.monotonic() - began
    try:
        if sweep(server.base_url, label, out, args) != 0:
            raise RuntimeError(f"load run against {label} failed; see {out / label}")
    finally:
        server.stop()
    return ready_s


def summary(out: Path, repeats: int) -> str:
    """Median over repetitions of each server's per-stage metric, and the ratio of the medians."""
    reports = {label: [json.loads((out / f"rep{i}" / label / "report.json").read_text()) for i in range(repeats)]
               for label in (VLLM, OURS)}
    head = ["users"] + [f"{name} {who}" for name, _ in RATIO_KEYS[:4] for who in ("vLLM", "ours", "ours/vLLM")]
    lines = [f"## median of {repeats} alternating repetitions: ours = moe-serve, vLLM = vllm api_server", "",
             "| " + " | ".join(head) + " |", "|---:|" + "---:|" * (len(head) - 1)]
    for k, stage in enumerate(reports[VLLM][0]["stages"]):
        cells = [str(stage["users"])]
        for _, key in RATIO_KEYS[:4]:
            med = {label: statistics.median(r["stages"][k][key] for r in reports[label]) for label in reports}
            cells += [f"{med[VLLM]:.2f}", f"{med[OURS]:.2f}", f"{med[OURS] / med[VLLM]:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    errors = {label: sum(s["errors"] for r in reports[label] for s in r["stages"]) for label in reports}
    return "\n".join(lines + ["", f"errors: vLLM {errors[VLLM]}, ours {errors[OURS]}", ""])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-users", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="alternating order: vLLM first in even repetitions")
    p.add_argument("--ready-timeout", type=float, default=400)
    args = p.parse_args()
    model_dir = ensure_embedded_model()
    # One server at a time: an idle vLLM CPU engine still holds its OpenMP threads, and on a
    # 2-core machine a second engine beside the measured one skews the comparison.
    for i in range(args.repeats):
        rep = args.out / f"rep{i}"
        rep.mkdir(parents=True, exist_ok=True)
        order = (VLLM, OURS) if i % 2 == 0 else (OURS, VLLM)
        ready = {label: run_one(label, rep, model_dir, args) for label in order}
        print(f"repetition {i}: ready in " + ", ".join(f"{k} {v:.1f} s" for k, v in ready.items()), flush=True)
        write_ab(rep / VLLM, rep / OURS, rep / "ab", VLLM, OURS)
    text = summary(args.out, args.repeats)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
