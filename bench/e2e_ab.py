"""End-to-end A/B on one GPU: stock vLLM MoE vs moe-serve's kernels, same load.

    python bench/e2e_ab.py --out runs/e2e                               # Mixtral-8x7B, one TP=8 rank, bf16: 525 s on one H200
    python bench/e2e_ab.py --out runs/e2e2 --variants optimized,vllm    # the other order (pool runs: bench/e2e_pool.py)
    python bench/e2e_ab.py --out runs/e2e-fp8 --server-arg=--quantization --server-arg=fp8
    python bench/e2e_ab.py --model embedded --out /tmp/ab --max-users 2 --step-seconds 2 --max-tokens 8   (CPU smoke)

For each variant (default: vllm, then optimized) it starts `python -m service` on a
dummy-weight model (bench/models/<name>/config.json + the Mixtral tokenizer written from
mistral_common), drives it with the `step` and `spike-sizes` scenarios through the asyncio
engine of `loadtest`, stops it, and finally prints the A/B
tables (B/A). Each variant starts on cold caches of its own (Triton, TorchInductor, vLLM's
compile cache: fresh temp dirs, removed afterwards; `--no-cold-cache` shares the user's), and
`spike-sizes` runs first: its TTFT is the cold-cache JIT effect, and it warms the server for
`step`, whose output tok/s is the warm throughput comparison. Everything is time-bounded; progress is printed as it goes and results are
written incrementally under --out: <variant>/<scenario>/{requests.jsonl,report.json,report.md},
server-<variant>.log, ab-<scenario>.{md,json}, summary.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dummy_model import dummy_model_dir  # noqa: E402
from loadtest.ab import write_ab  # noqa: E402
from loadtest.runner import Target, run  # noqa: E402
from loadtest.scenarios import Options, build  # noqa: E402
from loadtest.server_proc import ServerProcess  # noqa: E402

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[e2e_ab +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def prepare_model(name: str, out: Path) -> tuple[str, list[str]]:
    """(model dir, extra server args): dummy weights + written tokenizer, or the embedded model."""
    if name == "embedded":
        return "", []
    return str(dummy_model_dir(name, out)), ["--engine-arg", 'load_format="dummy"']


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mixtral-8x7b-tp8-rank", help="bench/models/<name>, or 'embedded' (CPU smoke)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="vllm,optimized", help="--moe-kernels values, A first")
    p.add_argument("--scenarios", default="spike-sizes,step", help="run in this order (the first sees cold caches)")
    p.add_argument("--cold-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="fresh Triton / TorchInductor / vLLM cache dirs per variant")
    p.add_argument("--max-users", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds per server start")
    p.add_argument("--server-arg", action="append", default=[], help="extra `python -m service` argument")
    p.add_argument("--tables-only", action="store_true",
                   help="no runs: write the A/B tables from the variant dirs already under --out "
                        "(for an A/B split over several invocations, one --variants value each)")
    return p.parse_args(argv)


def record_workers(server: ServerProcess, out: Path) -> list[dict]:
    """/version's per-worker plugin reports -> out/workers.json; log one line per rank (mode, MoE
    launches by path, its own Triton compiles by phase): under TP every rank must show our kernels."""
    import httpx

    try:
        response = httpx.get(f"{server.base_url}/version", headers=server.headers, timeout=10)
        workers = response.json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # the load results still count without it
        log(f"  /version unreadable, no per-rank report: {type(exc).__name__}: {exc}")
        return []
    out.mkdir(parents=True, exist_ok=True)
    (out / "workers.json").write_text(json.dumps(workers, indent=2))
    for w in workers:
        log(f"  rank {w['rank']} pid {w['pid']}: mode {w['mode']}, phase {w['phase']}, "
            f"tp_size {(w.get('kernel_info') or {}).get('tp_size')}, launches {w['moe_calls']}, "
            f"compiles {w['jit_compiles'] or 'none'}")
    return workers


def workers_line(variant: str, workers: list[dict]) -> str:
    """One summary line: ranks reporting and serving-phase compiles per rank."""
    def serving(w: dict) -> int:  # jit_compiles keys are "kernel|phase"
        return sum(v for k, v in w["jit_compiles"].items() if k.endswith("|serving"))

    per_rank = ", ".join(f"rank {w['rank']}: {serving(w)}" for w in workers)
    return f"Workers of {variant}: {len(workers)} reporting; serving-phase compiles {per_rank or 'n/a'}"


def run_variant(a: argparse.Namespace, variant: str, model_dir: str, model_args: list[str]) -> dict:
    """Start the server with --moe-kernels `variant`, run every scenario, stop it."""
    name = "moe-ab-model"
    args = ["--served-model-name", name, "--moe-kernels", variant, *model_args, *a.server_arg]
    if model_dir:
        args += ["--model", model_dir, "--max-model-len", str(a.max_model_len)]
    cache = Path(tempfile.mkdtemp(prefix=f"moe-ab-cache-{variant}-")) if a.cold_cache else None
    env = {} if cache is None else {"TRITON_CACHE_DIR": str(cache / "triton"), "VLLM_CACHE_ROOT": str(cache / "vllm"),
                                    "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    log(f"starting: {' '.join(f'{k}={v}' for k, v in env.items())} python -m service {' '.join(args)}")
    server = ServerProcess(a.out, *args, log_name=f"server-{variant}.log", env=env)
    result = {"variant": variant, "model": a.model, "server_args": args, "cold_cache": cache is not None,
              "scenarios": {}}
    try:
        result["ready_s"] = server.wait_ready(a.ready_timeout, progress=log)
        log(f"{variant}: ready in {result['ready_s']:.0f} s")
        opts = Options(max_users=a.max_users, step_seconds=a.step_seconds, max_tokens=a.max_tokens,
                       prompt_words=a.prompt_words, seed=a.seed)
        for scenario in a.scenarios.split(","):
            rep = run(scenario, opts, Target(server.base_url, name, label=variant), a.out / variant / scenario,
                      engine="asyncio", grace_s=60.0, plots=False)
            result["scenarios"][scenario] = rep["totals"]
            log(f"{variant}/{scenario}: " + ", ".join(f"u{s['users']}: {s['output_tok_s']:.0f} tok/s "
                                                       f"TTFT p50 {s['ttft_p50_ms'] or 0:.0f} ms"
                                                       for s in rep["stages"]))
        result["workers"] = record_workers(server, a.out / variant)
    finally:
        log(f"server stopped (exit {server.stop()})")
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    (a.out / f"variant-{variant}.json").write_text(json.dumps(result, indent=2))
    return result


def run_variants(a: argparse.Namespace, variants: list[str]) -> tuple[dict[str, dict], list[str]]:
    """Run each variant in turn; ({variant: result}, failed variants)."""
    per_variant = sum(build(s, Options(max_users=a.max_users, step_seconds=a.step_seconds)).duration
                      for s in a.scenarios.split(","))
    log(f"model {a.model}; variants {variants}; load {per_variant:.0f} s per variant "
        f"(+ server start, up to {a.ready_timeout:.0f} s each)")
    model_dir, model_args = prepare_model(a.model, a.out)
    results, failed = {}, []
    for v in variants:
        try:
            results[v] = run_variant(a, v, model_dir, model_args)
        except Exception as exc:  # noqa: BLE001 - keep going: the other variant's numbers still help
            log(f"{v} FAILED: {type(exc).__name__}: {exc}")
            failed.append(v)
    return results, failed


def load_variants(out: Path, variants: list[str]) -> tuple[dict[str, dict], list[str]]:
    """The variant-<v>.json files of earlier runs into `out`; ({variant: result}, missing variants)."""
    results = {v: json.loads((out / f"variant-{v}.json").read_text())
               for v in variants if (out / f"variant-{v}.json").is_file()}
    return results, [v for v in variants if v not in results]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM still stops the server (finally)
    a.out.mkdir(parents=True, exist_ok=True)
    variants = a.variants.split(",")
    results, failed = load_variants(a.out, variants) if a.tables_only else run_variants(a, variants)
    model = next((r["model"] for r in results.values() if "model" in r), a.model)
    summary = [f"# e2e A/B: {model}, A = {variants[0]}, B = {variants[-1]}", "",
               f"`{' '.join(sys.argv)}`", "",
               "Ready after start (s): " + ", ".join(f"{v} {r['ready_s']:.0f}" for v, r in results.items())
               + f"; caches: {'cold per variant' if a.cold_cache else 'shared'}", ""]
    summary += [workers_line(v, r["workers"]) for v, r in results.items() if "workers" in r] + [""]
    if len(variants) == 2 and not failed:
        for scenario in a.scenarios.split(","):
            write_ab(a.out / variants[0] / scenario, a.out / variants[1] / scenario, a.out / f"ab-{scenario}",
                     variants[0], variants[1])
            summary.append((a.out / f"ab-{scenario}" / "ab.md").read_text())
    else:
        summary.append(f"no A/B table: variants {failed} failed or missing" if failed
                       else "no A/B table: one variant")
    (a.out / "summary.md").write_text("\n".join(summary))
    print("\n".join(summary), flush=True)
    log("done")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
