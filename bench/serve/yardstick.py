"""The yardstick: moe-serve against `vllm serve` on a whole model over HTTP (`moe-serve bench serve`).

    moe-serve bench serve --model qwen3-30b-a3b --out DIR [--processes 3] [--routing uniform_random]
                          [--vllm-tuned-config-folder DIR]
    moe-serve bench serve ... --out DIR            # again: resumes, skips finished processes
    moe-serve bench serve report DIR [DIR...]      # the pooled markdown table
    moe-serve bench serve verify DIR [DIR...]      # is every process publishable (verify.py)

**Primary metrics, fixed before any run: c = 1 ITL p50 (as the weights route) and c = 8 output
tok/s under realistic expert load (`--routing uniform_random`).**

Starts one server at a time on the same GPU(s), each a fresh process: `vllm-serve` (`python -m
vllm.entrypoints.openai.api_server`, no vLLM plugin), `moe-serve-vllm-kernels` (`python -m moe_serve.service
--moe-kernels vllm`: what our frontend costs; only every `--frontend-every` K-th round) and
`moe-serve` (`python -m moe_serve.service`, as shipped), on the same model (bench/models/<name> with dummy
weights, `--model embedded`, or `--model-dir` any local HF dir) with identical engine flags
(servers.py). Round r runs the variants in rotated order (three variants: every second cycle of
rotations reversed, so each variant takes each position and precedes each other one equally often).
After `--processes` rounds, rounds are added up to `--max-processes` while a primary cell has fewer
processes than its interval needs (schedule.py: 3 + 3, 4 + 4 where it is wider than 2 %).

`vllm serve` runs the best MoE table vLLM can use on the GPU (baseline_table.py): vLLM reads
`VLLM_TUNED_CONFIG_FOLDER` first, then the tables it ships; `--vllm-tuned-config-folder DIR` (a
folder of vLLM-format tables, e.g. what `moe-serve tune --for-vllm` wrote) sets it for every
server alike (it changes only vLLM's own kernel). Every process records which table that is and
the line of its server log that shows vLLM loaded it (or ran its untuned default).

Expert load (`--routing`): `weights` routes as the model's router does (dummy weights crowd a
batch's tokens onto few experts; at c = 1 a token reads its top-k experts whatever the weights);
a vLLM routing-simulation strategy (`uniform_random`, `normal_routing`) is set identically in every
server, which is how a real model's traffic loads the experts at c >= 8.

Each server gets closed-loop streaming loads at every `--concurrency` c: first an untimed pass
over every level (one-time compiles of a fresh server), then per level a warm-up and
`--requests-per-level` requests with exactly c in flight, fixed prompt and output lengths
(load.py; request counts and process order in schedule.py); then the fixed prompts of answers.py
(teacher-forced log-probabilities, to compare the servers' answers). Ratios, intervals and the
byte floor come from stats.py, the tables from render.py.

Files: DIR/<variant>/r<round>/ meta.json (host, GPU, driver, commit, dirty flag and source digest,
versions, flags, the environment that decides what the server ran (run_env.py), vLLM's MoE table
and what the log says of it, start/ready/end times, copy ceiling, byte-floor bytes per c, the
engine configuration vLLM logged; process.py), requests.jsonl (one line per request, as it
finishes), api_cpu.json (CPU seconds of the server's API process over each timed level),
answers.json, server.log, version.json and moe_metrics.txt (what the server reports it ran),
profile.json (with --profile) and `complete` once the process finished. A process with a `complete` marker is never run again; an unfinished one is redone from
scratch. `--budget-s` stops before a process the budget cannot hold (the longest of the variant's
last two processes on this host, or `--expect-process-s`): run the same command again to go on.
`--profile` profiles the next process of every variant that has no profile in DIR yet (after its
timed levels, c in `--profile-levels`; profile.py). On the GPU the copy ceiling is measured once
per invocation before any server starts (host.py) unless `--copy-ceiling-tbs` gives it; on the CPU
engine the floor column stays empty.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_serve.bench.model_dirs import config_sha, decodable_ids, dummy_model_dir
from moe_serve.bench.serve import baseline_table, roofline, run_env
from moe_serve.bench.serve import host as serve_host
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve import verify
from moe_serve.bench.serve.process import run_process
from moe_serve.bench.serve.schedule import MIN_PROCESSES, WIDE_PROCESSES, more_rounds, plan, requests_at, warmup_count
from moe_serve.bench.serve.servers import (ALL_VARIANTS, BASELINE, CPU_KV_CACHE_BYTES, FRONTEND, VARIANTS, WEIGHTS,
                                 EngineFlags, routing_env)

T0 = time.monotonic()
PROBE_S = 60.0                 # what the host probe (imports, copy ceiling) may take before the first process


def log(msg: str) -> None:
    print(f"[bench serve {time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def model_setup(a: argparse.Namespace) -> tuple[Path, str, str | None]:
    """(model dir, model name, load format): bench/models/<name> with dummy weights, the embedded
    model, or a local directory."""
    if a.model_dir:
        return Path(a.model_dir).resolve(), Path(a.model_dir).name, None if a.load_format == "auto" else a.load_format
    if a.model == "embedded":
        from moe_serve.service.embedded_model import ensure_embedded_model

        return ensure_embedded_model(), "embedded", None
    return dummy_model_dir(a.model, a.out).resolve(), a.model, "dummy"


def on_gpu() -> bool:
    """An NVIDIA GPU is visible (device nodes or the driver's list)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or any(Path("/proc/driver/nvidia/gpus").glob("*"))


def workload_of(a: argparse.Namespace, name: str, cfg: dict[str, Any], flags: EngineFlags,
                prompt_vocab: int) -> dict[str, Any]:
    return {"model": name, "config_sha256": config_sha(cfg), "levels": a.levels, "prompt_tokens": a.prompt_tokens,
            "output_tokens": a.output_tokens, "engine": flags.as_dict(), "warmup_pass": a.warmup_pass,
            "prompt_vocab": prompt_vocab}


def floor_bytes(cfg: dict[str, Any], tp: int, levels: list[int], context: float) -> dict[str, float] | None:
    """Per level c: the bytes a decode step of c sequences reads (weights, experts hit under uniform
    routing, KV cache of `context` tokens each); None for a model family roofline.py does not know."""
    try:
        return {str(c): roofline.byte_floor(cfg, tp, c, context)["total"] for c in levels}
    except (ValueError, KeyError):
        return None


def expected_walls(out: Path, host: str) -> dict[tuple[str, bool], float]:
    """(variant, profiled) -> the longer wall seconds of its last two complete processes on this host."""
    walls: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for m in out.glob(f"*/r*/{serve_stats.COMPLETE}"):
        meta = json.loads((m.parent / "meta.json").read_text())
        if meta.get("host") == host:
            walls.setdefault((meta["variant"], meta["profiled"]), []).append((meta["end"], meta["wall_s"]))
    return {k: max(w for _, w in sorted(ws)[-2:]) for k, ws in walls.items()}


def profiled_variants(out: Path) -> set[str]:
    """Variants with a complete process in `out` whose profile succeeded."""
    return {p.variant for p in serve_stats.load([out]) if "levels" in p.meta.get("profile", {})}


def host_meta(a: argparse.Namespace, host: str, work: dict[str, Any], cfg: dict[str, Any],
              model_dir: Path) -> dict[str, Any]:
    """What every process of this call records: machine, versions, commit, copy ceiling, workload,
    the MoE table vLLM will load (baseline_table.expected). Also gives every variant's server the
    environment moe-serve gives vLLM."""
    from moe_serve.service.engine import default_engine_env

    default_engine_env()
    probe = serve_host.probe()                  # in a subprocess: the GPU is free again after it
    ceiling = a.copy_ceiling_tbs * 1e12 if a.copy_ceiling_tbs else probe["copy_ceiling_bps"]
    tuned = os.environ.get(run_env.TUNED_ENV)
    table = baseline_table.expected(cfg, a.tensor_parallel_size, probe["gpu"], Path(tuned) if tuned else None,
                                    baseline_table.shipped_dir())
    log(f"host {host}, {probe['gpu']} (driver {probe['driver']}), copy ceiling "
        + (f"{ceiling / 1e12:.2f} TB/s" if ceiling else "n/a") + f", vLLM {probe['vllm']}, torch {probe['torch']}; "
        f"`vllm serve`'s MoE table: {baseline_table.label([table])}")
    code = serve_host.commit(a.commit)
    if code["dirty"]:
        log("the tree has uncommitted changes: these processes cannot be published (verify refuses them)")
    return {"host": host, **probe, "copy_ceiling_bps": ceiling,
            "copy_ceiling_source": "flag" if a.copy_ceiling_tbs else "measured",
            **code, "workload": work, "vllm_moe_table": table,
            "requests_per_level": {str(c): requests_at(c, a.requests_per_level) for c in a.levels},
            "warmup_per_level": {str(c): warmup_count(c) for c in a.levels},
            "floor_bytes": floor_bytes(cfg, a.tensor_parallel_size, a.levels, a.prompt_tokens + a.output_tokens / 2),
            "model_dir": str(model_dir)}


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")     # unwinds through every finally: servers are stopped


@dataclass
class Call:
    """One invocation: its arguments, model, engine flags, workload, clock, and what it learned."""

    a: argparse.Namespace
    model_dir: Path
    cfg: dict[str, Any]
    flags: EngineFlags
    work: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    host: str = field(default_factory=serve_host.host_name)
    meta0: dict[str, Any] | None = None
    failed: set[str] = field(default_factory=set)


def same_setup(c: Call) -> str | None:
    """Why this call's servers would run otherwise than the processes already in --out (their
    vLLM MoE table, or the environment every server of a run shares); None where they would not."""
    assert c.meta0 is not None
    mine = run_env.shared(run_env.record(routing_env(c.flags.routing), []))
    for p in serve_stats.load([c.a.out]):
        if "vllm_moe_table" in p.meta and p.meta["vllm_moe_table"] != c.meta0["vllm_moe_table"]:
            return f"{p.dir} ran vLLM's MoE table {baseline_table.label([p.meta['vllm_moe_table']])}"
        if "environment" in p.meta and run_env.shared(p.meta["environment"]) != mine:
            return f"{p.dir} ran another shared environment: {run_env.shared(p.meta['environment'])}"
    return None


def run_rounds(c: Call, rounds: int) -> int:
    """Every unfinished process of rounds 0..rounds-1; 0, 1 (a variant failed), 2 (another
    setup in --out) or 3 (the budget ran out)."""
    a = c.a
    todo = [(r, v) for r, v in plan(a.variants, rounds, a.frontend_every)
            if v not in c.failed and not (a.out / v / f"r{r}" / serve_stats.COMPLETE).is_file()]
    log(f"{c.work['model']}: {len(todo)} processes to run in {a.out} (expert load: {a.routing}); primary metrics: "
        "c = 1 ITL p50 (as the weights route) and c = 8 output tok/s (uniform routing)")
    vocab = c.work["prompt_vocab"]
    for i, (r, v) in enumerate(todo):
        if v in c.failed:
            continue
        profile = a.profile and v not in profiled_variants(a.out)
        walls = expected_walls(a.out, c.host)
        need = walls.get((v, profile)) or (walls.get((v, False), a.expect_process_s)
                                            + (a.expect_profile_s if profile else 0))
        need += PROBE_S if c.meta0 is None else 0
        left = a.budget_s - (time.monotonic() - c.started)
        if left < need:
            log(f"budget: {left:.0f} s left < {need:.0f} s for {v}; stopping with {len(todo) - i} processes to go "
                "(run the same command to resume)")
            return 3
        if c.meta0 is None:
            c.meta0 = host_meta(a, c.host, c.work, c.cfg, c.model_dir)
            if why := same_setup(c):
                log(f"{why}; use another --out")
                return 2
        log(f"process {i + 1}/{len(todo)}: round {r} {v}" + (" (profiled)" if profile else ""))
        try:
            wall = run_process(a, v, r, (c.model_dir, vocab), c.flags, c.meta0, profile, log)
        except (RuntimeError, TimeoutError, OSError) as e:
            log(f"FAILED {v} r{r}: {type(e).__name__}: {str(e)[-1500:]}\n  skipping {v}'s other processes in this call")
            c.failed.add(v)
            continue
        log(f"round {r} {v} done in {wall:.0f} s")
    return 1 if c.failed else 0


def short_cells(out: Path, variants: list[str]) -> list[str]:
    """The primary cells of the run in `out` short of processes for their interval (schedule.more_rounds)."""
    procs = serve_stats.load([out])
    return more_rounds(serve_stats.pooled_rows(procs, BASELINE, tuple(variants))) if procs else []


def run(a: argparse.Namespace) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    if a.vllm_tuned_config_folder:
        if not a.vllm_tuned_config_folder.is_dir():
            log(f"--vllm-tuned-config-folder {a.vllm_tuned_config_folder}: no such folder")
            return 2
        os.environ[run_env.TUNED_ENV] = str(a.vllm_tuned_config_folder.resolve())   # every server inherits it
    model_dir, name, load_format = model_setup(a)
    cfg = json.loads((model_dir / "config.json").read_text())
    gpu = on_gpu()
    flags = EngineFlags(load_format=load_format, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                        tensor_parallel_size=a.tensor_parallel_size,
                        gpu_memory_utilization=a.gpu_memory_utilization if gpu else None,
                        kv_cache_memory_bytes=None if gpu else CPU_KV_CACHE_BYTES, routing=a.routing)
    c = Call(a, model_dir, cfg, flags, workload_of(a, name, cfg, flags, decodable_ids(model_dir, cfg["vocab_size"])))
    others = [p.dir for p in serve_stats.load([a.out]) if serve_stats.workload(p.meta) != c.work]
    if others:
        log(f"{len(others)} processes in {a.out} ran another workload (e.g. {others[0]}); use another --out")
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    rounds = a.processes
    while True:
        code = run_rounds(c, rounds)
        if code or rounds >= a.max_processes or BASELINE not in a.variants:
            return code
        try:
            short = short_cells(a.out, a.variants)
        except ImportError as e:         # scipy (the intervals) is not on every GPU host
            log(f"no interval here ({e}): run with --processes {a.max_processes} to add rounds")
            return code
        if not short:
            return code
        log(f"adding round {rounds}: {'; '.join(short)}")
        rounds += 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe-serve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Time on one H200 or H100: engine start 50-170 s per process, then the loads: "
                                       "about 30 s at c = 1 alone, about 3.5 min over the default levels "
                                       "(16 waves of c each, 32 at c = 8); --concurrency 1 with 4 variants x 3 "
                                       "processes took 19 min on an H100.")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--model", default="qwen3-30b-a3b", help="bench/models/<name> (dummy weights) or 'embedded'")
    p.add_argument("--model-dir", help="a local HF model directory instead of --model")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto", help="with --model-dir")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help=f"comma list of {', '.join(ALL_VARIANTS)} (default: {', '.join(VARIANTS)})")
    p.add_argument("--processes", type=int, default=MIN_PROCESSES, help="rounds: processes per variant")
    p.add_argument("--max-processes", type=int, default=None,
                   help="add rounds up to this many while a primary cell's interval needs more processes (default: "
                        f"{WIDE_PROCESSES} where --processes is at least {MIN_PROCESSES}, a headline run; else none)")
    p.add_argument("--vllm-tuned-config-folder", type=Path, default=None,
                   help="VLLM_TUNED_CONFIG_FOLDER for every server: vLLM-format MoE tables (e.g. from `moe-serve "
                        "tune --for-vllm`), which vLLM's own kernel reads before the tables it ships")
    p.add_argument("--frontend-every", type=int, default=2, help=f"{FRONTEND} runs in every K-th round only")
    p.add_argument("--concurrency", dest="levels", type=ints, default=[1, 8, 32, 64, 128])
    p.add_argument("--routing", default=WEIGHTS,
                   help=f"expert load: '{WEIGHTS}' (as the model routes) or a vLLM routing simulation strategy "
                        "set in every server (uniform_random, normal_routing)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--no-warmup-pass", dest="warmup_pass", action="store_false",
                   help="skip the untimed pass over every level before the timed one (then a fresh "
                        "server's one-time JIT compiles and allocations fall into the timed levels)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="default max(16c, 32), at c >= 8 at least 256")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no process this call cannot finish")
    p.add_argument("--expect-process-s", type=float, default=240.0,
                   help="a variant's process time until one has run on this host")
    p.add_argument("--expect-profile-s", type=float, default=90.0, help="what a profile adds, until one ran here")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--copy-ceiling-tbs", type=float, default=None, help="instead of measuring it (TB/s, read+written)")
    p.add_argument("--commit", default=None, help="the commit to record where this checkout has no .git")
    p.add_argument("--profile", action="store_true", help="profile one process per variant (see above)")
    p.add_argument("--profile-levels", type=ints, default=[1, 32])
    p.add_argument("--profile-tokens", type=lambda s: tuple(ints(s)), default=(16, 80), help="short,long")
    p.add_argument("--keep-traces", action="store_true", help="keep the raw traces in kept-traces/")
    a = p.parse_args(argv)
    if a.max_processes is None:
        a.max_processes = max(a.processes, WIDE_PROCESSES) if a.processes >= MIN_PROCESSES else a.processes
    unknown = set(a.variants) - set(ALL_VARIANTS)
    if unknown or len(a.profile_tokens) != 2 or a.profile_tokens[0] >= a.profile_tokens[1]:
        p.error(f"unknown variants {sorted(unknown)}" if unknown else "--profile-tokens wants short,long with short < long")
    return a


def report(argv: list[str]) -> int:
    from moe_serve.bench.serve.render import results_table

    p = argparse.ArgumentParser(prog="moe-serve bench serve report", description="pooled table of yardstick runs")
    p.add_argument("dirs", nargs="+", type=Path)
    print("\n".join(results_table(*p.parse_args(argv).dirs)))
    return 0


SUBCOMMANDS = {"report": report, "verify": verify.main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    a = parse_args(argv)
    code = run(a)
    if code in (0, 3) and serve_stats.load([a.out]):
        try:
            report([str(a.out)])
        except ImportError as e:         # scipy (the intervals) is not on every GPU host
            log(f"no table here ({e}): run `moe-serve bench serve report {a.out}` where scipy is installed")
    return code

