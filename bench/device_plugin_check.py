"""Device check of the vLLM plugin: our kernels active in every worker, and Triton compiles
while serving, for --moe-kernels optimized vs vllm, on a dummy-weight MoE model.

    python bench/device_plugin_check.py --out runs/plugin-check           # GPU with vLLM
    python bench/device_plugin_check.py --model qwen3-30b-a3b --layers 2 --out runs/plugin-check-qwen3
    python bench/device_plugin_check.py --cpu-smoke --out /tmp/plugin-check   # CPU, embedded model

Per mode: starts `python -m service` (own session, log in --out), waits for /health (bounded),
reads the workers' reports from /metrics, drives concurrent waves of 1..64 requests with
varied prompt lengths (asyncio + httpx), reads /metrics again and prints the serving-phase
Triton compiles per kernel, launches through our kernels, and a final table. Serving compiles
count only from workers in phase `serving` (a worker still in `warmup` would count its
compiles as warm-up ones): the table says n/a otherwise. Every wait is bounded; progress is
printed with flush.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.dummy_model import dummy_model_dir  # noqa: E402
from loadtest.server_proc import ServerProcess  # noqa: E402

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[plugin-check +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def scrape(url: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def compiles(m: dict, phase: str) -> dict[str, float]:
    return {lab["kernel"]: v for name, lab, v in m.get("moe_serve_triton_jit_compiles", [])
            if name.endswith("_total") and lab["phase"] == phase}


def launches(m: dict) -> dict[str, float]:
    return {lab["path"]: v for name, lab, v in m.get("moe_serve_moe_kernel_launches", []) if name.endswith("_total")}


def workers(m: dict) -> list[dict]:
    return [lab for _, lab, _ in m.get("moe_serve_vllm_worker_info", [])]


async def sweep(url: str, model: str, conc: list[int], max_tokens: int, deadline_s: float) -> dict:
    """Waves of c concurrent completions, prompt lengths varied per request; bounded."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while experts route tokens".split()
    stats = {"ok": 0, "err": 0, "waves": []}
    end = time.monotonic() + deadline_s
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=10)) as client:
        async def one() -> bool:
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 300)))
            try:
                r = await client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                               "max_tokens": max_tokens, "ignore_eos": True})
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        for c in conc:
            if time.monotonic() > end:
                log(f"  sweep deadline reached before c={c}")
                break
            t = time.monotonic()
            try:
                res = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(c))),
                                             timeout=max(5.0, end - time.monotonic()))
            except asyncio.TimeoutError:
                res = [False] * c
            ok = sum(res)
            stats["ok"] += ok
            stats["err"] += c - ok
            stats["waves"].append({"c": c, "ok": ok, "s": round(time.monotonic() - t, 2)})
            log(f"  c={c:3d}: {ok}/{c} ok in {time.monotonic() - t:.2f}s")
    return stats


def run_mode(a: argparse.Namespace, mode: str, base_args: list[str], model: str, env: dict) -> dict:
    left = a.deadline - (time.monotonic() - T0)
    if left < 90:
        log(f"== {mode}: skipped, {left:.0f}s left of --deadline")
        return {"mode": mode, "error": "skipped: --deadline reached"}
    log(f"== {mode}: starting server ({left:.0f}s left of --deadline)")
    srv = ServerProcess(a.out, *base_args, "--moe-kernels", mode, env=env, log_name=f"server-{mode}.log")
    res: dict = {"mode": mode}
    try:
        res["ready_s"] = round(srv.wait_ready(min(a.ready_timeout, left - 60), progress=log), 1)
        log(f"  ready in {res['ready_s']}s")
        before = scrape(srv.base_url)
        res["workers"] = workers(before)
        res["warmup_compiles"] = compiles(before, "warmup")
        res["serving_compiles_at_ready"] = compiles(before, "serving")
        log(f"  workers: {res['workers']}")
        t = time.monotonic()
        res["sweep"] = asyncio.run(sweep(srv.base_url, model, a.concurrency, a.max_tokens,
                                   min(a.sweep_timeout, max(10.0, a.deadline - (time.monotonic() - T0) - 45))))
        res["sweep_s"] = round(time.monotonic() - t, 1)
        after = scrape(srv.base_url)
        res["workers"] = workers(after)
        res["serving_compiles"] = compiles(after, "serving")
        res["launches"] = launches(after)
        res["kernel_info"] = [lab for _, lab, _ in after.get("moe_serve_moe_kernel_info", [])]
        res["warn_lines"] = [ln[:300] for ln in srv.log_path.read_text(errors="replace").splitlines()
                             if "during serving" in ln][:20]
        res["warmup_lines"] = [ln[:200] for ln in srv.log_path.read_text(errors="replace").splitlines()
                               if "[moe-serve layer warm-up]" in ln][:16]
    except Exception as exc:  # noqa: BLE001 - report and continue with the next mode
        res["error"] = repr(exc)
        log(f"  ERROR {exc!r}; log tail: {srv.tail(15)}")
    finally:
        srv.stop()
        log(f"  stopped {mode}")
    return res


def checks(r: dict, cpu: bool) -> list[str]:
    """Human-readable verdicts for one mode."""
    out = []
    ws = r.get("workers") or []
    out.append(f"{'OK ' if ws and all(w['mode'] == r['mode'] for w in ws) else 'BAD'} every worker reports "
               f"mode={r['mode']} ({len(ws)} workers, pids {[w['pid'] for w in ws]})")
    if r["mode"] == "optimized":
        out.append(f"{'OK ' if ws and all(w['moe_hook'] == 'installed' for w in ws) else 'BAD'} hook installed in all")
        n = (r.get("launches") or {}).get("optimized", 0)
        out.append(f"{'OK ' if n > 0 or cpu else 'BAD'} our kernel calls: {n:.0f}"
                   f"{' (CPU: vLLM cpu_fused_moe path, 0 expected)' if cpu else ''}; "
                   f"fallback: {(r.get('launches') or {}).get('fallback', 0):.0f}")
    serving = bool(ws) and all(w["phase"] == "serving" for w in ws)
    out.append(f"{'OK ' if serving else 'BAD'} every worker in phase serving: {[w['phase'] for w in ws]}")
    total = sum((r.get("serving_compiles") or {}).values())
    if serving:
        out.append(f"{'OK ' if total == 0 else 'NOTE'} serving-phase compiles: {total:.0f} {r.get('serving_compiles')}")
    return out


def serving_compiles(r: dict) -> str:
    """Serving-phase compiles, or n/a when a worker never reached phase serving."""
    ws = r.get("workers") or []
    if not ws or any(w["phase"] != "serving" for w in ws):
        return "n/a (worker not in phase serving)"
    return f"{sum((r.get('serving_compiles') or {}).values()):.0f}"


def table(results: list[dict]) -> str:
    rows = ["| mode | ready s | workers | launches ours/fallback | warm-up compiles | serving compiles | requests ok/err |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        la = r.get("launches") or {}
        sw = r.get("sweep") or {}
        rows.append(f"| {r['mode']} | {r.get('ready_s', '-')} | {len(r.get('workers') or [])} | "
                    f"{la.get('optimized', 0):.0f}/{la.get('fallback', 0):.0f} | "
                    f"{sum((r.get('warmup_compiles') or {}).values()):.0f} | "
                    f"{serving_compiles(r)} | {sw.get('ok', 0)}/{sw.get('err', 0)} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mixtral-8x7b", help="bench/models/<name>/config.json")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--modes", default="optimized,vllm")
    p.add_argument("--concurrency", default="1,2,3,4,5,6,7,8,12,16,24,32,48,64")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--sweep-timeout", type=float, default=90)
    p.add_argument("--deadline", type=float, default=1200, help="seconds for the whole run (all modes)")
    p.add_argument("--server-arg", action="append", default=[], help="extra server flag, repeatable")
    p.add_argument("--cpu-smoke", action="store_true", help="embedded model on the CPU engine, tiny sweep")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.concurrency = "1,2,3" if a.concurrency == p.get_default("concurrency") else a.concurrency
        a.max_tokens = min(a.max_tokens, 4)
    a.concurrency = [int(c) for c in str(a.concurrency).split(",") if c]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TRITON_INTERPRET", None)  # real compiles in the server's workers
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if a.cpu_smoke:
        model, base = "moe-serve-tiny-mixtral", ["--tensor-parallel-size", "1"]
    else:
        d = dummy_model_dir(a.model, a.out, a.layers)
        model = str(d)
        base = ["--model", str(d), "--engine-arg", "load_format=dummy", "--max-model-len", "4096",
                "--tensor-parallel-size", "1"]
    base += a.server_arg
    log(f"model {model}; modes {a.modes}; concurrency {a.concurrency}; out {a.out}")
    results = [run_mode(a, m, base, model, env) for m in a.modes.split(",") if m]
    print("\n" + table(results), flush=True)
    for r in results:
        print(f"\n[{r['mode']}]" + (f" ERROR: {r['error']}" if "error" in r else ""), flush=True)
        for line in checks(r, a.cpu_smoke):
            print("  " + line, flush=True)
        for line in r.get("warmup_lines", []):
            print("  " + line, flush=True)
        for line in r.get("warn_lines", [])[:5]:
            print("  warn: " + line, flush=True)
    (a.out / "plugin_check.json").write_text(json.dumps(results, indent=2, default=str))
    (a.out / "plugin_check.md").write_text(table(results) + "\n")
    log(f"wrote {a.out / 'plugin_check.json'}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
