"""One yardstick process: a fresh server start, its loads, what it says it ran, its stop.

Files in DIR/<variant>/r<round>/: meta.json (the call's record, bench/serve/yardstick.py, plus
this process's argv, its environment (run_env.py), start/ready/end times, the engine
configuration and backends vLLM logged, and the MoE tables vLLM's log says it loaded or missed:
`vllm_moe_table_logged`, baseline_table.logged), server.log, requests.jsonl, api_cpu.json,
answers.json, version.json, moe_metrics.txt, profile.json (profiled processes) and `complete`
once it finished.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from moe_serve.bench.serve import answers, baseline_table
from moe_serve.bench.serve import profile as serve_profile
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve.load import LoadClient
from moe_serve.bench.serve.schedule import requests_at, warmup_count, warmup_pass_count
from moe_serve.bench.serve.servers import SERVED_NAME, WEIGHTS, EngineFlags, Server, chosen_backends, engine_config

Log = Callable[[str], None]


async def drive(server: Server, a: argparse.Namespace, vocab: int, pdir: Path, profile: bool, log: Log) -> None:
    """The timed levels, then (profile) the profiled bursts; every request into requests.jsonl, the
    API process's CPU time per timed level (warm-up and measured requests) into api_cpu.json.
    Prompts are token ids below `vocab` (ids the model's tokenizer decodes)."""
    client = LoadClient(server.base_url, SERVED_NAME, a.prompt_tokens, vocab, pdir / "requests.jsonl")
    api_cpu: dict[str, dict[str, float]] = {}
    try:
        if a.warmup_pass:   # every level once before any is timed: one-time compiles and
            for stage, c in enumerate(a.levels):   # allocations of every batch size land here
                await client.level(stage, c, warmup_pass_count(c), 0, a.output_tokens)
        for stage, c in enumerate(a.levels):
            cpu_before = server.api_cpu_s()
            recs = await client.level(stage, c, warmup_count(c), requests_at(c, a.requests_per_level), a.output_tokens)
            api_cpu[str(c)] = {"cpu_s": server.api_cpu_s() - cpu_before, "requests": len(recs),
                               "output_tokens": sum(r.output_tokens for r in recs if r.status == "ok")}
            (pdir / serve_stats.API_CPU).write_text(json.dumps(api_cpu))
            measured = [asdict(r) for r in recs if r.phase == "measured"]
            x = serve_stats.cell(measured, a.output_tokens, None)
            if x["errors"] == len(measured):
                raise RuntimeError(f"c={c}: every measured request failed, e.g. {x['error']}")
            log(f"  c={c}: " + (f"{x['errors']} of {len(measured)} requests failed: {x['error']}" if x["errors"] else
                                f"ITL p50 {x['itl_p50_ms']:.3f} ms, TTFT p50 {x['ttft_p50_ms']:.1f} ms, "
                                f"{x['tok_s']:.1f} tok/s ({len(measured)} requests)"))
        if a.routing == WEIGHTS:  # a routing simulation draws experts at random: answers only as the weights route
            try:
                said = await answers.collect(client.http, server.base_url, SERVED_NAME, vocab)
                (pdir / answers.ANSWERS).write_text(json.dumps(said))
                log(f"  answers: {len(said['prompts'])} prompts, teacher-forced")
            except (httpx.HTTPError, ValueError, KeyError) as e:
                log(f"  answers failed: {type(e).__name__}: {str(e)[:300]}")
        if profile:
            out: dict[str, Any] = {"levels": {}}
            try:
                for c in a.profile_levels:
                    out["levels"][str(c)] = await serve_profile.capture(
                        client, len(a.levels), c, a.profile_tokens, pdir / "traces",
                        pdir / "kept-traces" if a.keep_traces else None)
                    log(f"  c={c}: profiled")
            except Exception as e:  # noqa: BLE001 - the timed levels stand; the next process profiles again
                log(f"  profile failed: {type(e).__name__}: {e}")
                out = {"error": f"{type(e).__name__}: {e}"[:500]}
            (pdir / "profile.json").write_text(json.dumps(out))
            shutil.rmtree(pdir / "traces", ignore_errors=True)
    finally:
        await client.close()


def snapshot(base_url: str, pdir: Path, log: Log) -> None:
    """What the server says it ran, after its loads: /version (JSON) into version.json and its
    moe_serve_* Prometheus samples (kernel launches by path, fallbacks, fused-router calls, JIT
    compiles) into moe_metrics.txt. `vllm serve` has no moe_serve_* samples: the file is empty."""
    for route, name in (("/version", "version.json"), ("/metrics", "moe_metrics.txt")):
        try:
            r = httpx.get(base_url + route, timeout=10.0)
            r.raise_for_status()
        except httpx.HTTPError as e:
            log(f"  {route}: {type(e).__name__}: {e}")
            continue
        text = r.text if route == "/version" else "".join(
            line + "\n" for line in r.text.splitlines() if line.startswith("moe_serve_"))
        (pdir / name).write_text(text)


def run_process(a: argparse.Namespace, variant: str, rnd: int, model: tuple[Path, int],
                flags: EngineFlags, meta0: dict[str, Any], profile: bool, log: Log) -> float:
    """One server start, its loads, its stop; returns wall seconds. Raises on failure (files kept).
    `model` is (model dir, the ids its prompts may use)."""
    model_dir, vocab = model
    pdir = a.out / variant / f"r{rnd}"
    shutil.rmtree(pdir, ignore_errors=True)         # an unfinished earlier try is redone whole
    pdir.mkdir(parents=True)
    began = time.time()
    meta = {**meta0, "variant": variant, "round": rnd, "profiled": profile, "start": began}

    def write() -> None:
        (pdir / "meta.json").write_text(json.dumps(meta, indent=1))

    server = Server(variant, pdir / "server.log", model_dir, flags, pdir / "traces" if profile else None)
    meta["argv"], meta["environment"] = server.argv, server.environment
    write()
    try:
        meta["ready_s"] = server.wait_ready(a.ready_timeout_s, log)
        meta["ready"] = time.time()
        log(f"  ready in {meta['ready_s']:.0f} s")
        log_text = (pdir / "server.log").read_text(errors="replace")
        meta["engine_config"], meta["backends"] = engine_config(log_text), chosen_backends(log_text)
        if meta["engine_config"] is None:
            log("  the server log holds no engine configuration line")
        write()
        asyncio.run(drive(server, a, vocab, pdir, profile, log))
        snapshot(server.base_url, pdir, log)
    except BaseException as e:
        meta["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        meta["exit_code"] = server.stop()
        meta["end"] = time.time()
        meta["wall_s"] = meta["end"] - began
        meta["vllm_moe_table_logged"] = baseline_table.logged((pdir / "server.log").read_text(errors="replace"))
        write()
    (pdir / serve_stats.COMPLETE).write_text(json.dumps({"end": meta["end"]}))
    return meta["wall_s"]
