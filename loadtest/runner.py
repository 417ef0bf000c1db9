"""Run one scenario against one server with either engine, then write the report."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moe_serve.loadtest import expert_load, prom
from moe_serve.loadtest.records import RECORDS_FILE
from moe_serve.loadtest.report import write_report
from moe_serve.loadtest.scenarios import Options, Scenario, build

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


@dataclass
class Target:
    host: str
    model: str
    api_key: str = ""
    metrics_api_key: str = ""
    label: str = ""


def locust_command(sc: Scenario, t: Target, out: Path) -> list[str]:
    """The headless `locust` command line for scenario `sc` (CSV prefix out/locust)."""
    o = sc.options
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", t.host,
            "--csv", str(out / "locust"), "--csv-full-history", "--only-summary", "--loglevel", "WARNING",
            "--lt-scenario", sc.name, "--lt-model", t.model, "--lt-api-key", t.api_key,
            "--lt-max-users", str(o.max_users), "--lt-step-seconds", str(o.step_seconds),
            "--lt-max-tokens", str(o.max_tokens), "--lt-prompt-words", str(o.prompt_words),
            "--lt-seed", str(o.seed), "--lt-records", str(out / RECORDS_FILE)]


def _run_locust(sc: Scenario, t: Target, out: Path, grace_s: float) -> int:
    cmd = locust_command(sc, t, out)
    with open(out / "locust.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=sc.duration + grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            return -9


def _command_line() -> str:
    """How this process was started, as `python -m moe_serve.loadtest ...` where it was."""
    argv = list(sys.argv)
    for i, arg in enumerate(argv):  # never write keys into reports
        if i and argv[i - 1] in ("--api-key", "--metrics-api-key"):
            argv[i] = "***"
        elif arg.startswith(("--api-key=", "--metrics-api-key=")):
            argv[i] = arg.split("=", 1)[0] + "=***"
    if argv and argv[0].endswith(("loadtest/__main__.py", "loadtest/cli.py")):
        return shlex.join(["python", "-m", "moe_serve.loadtest", *argv[1:]])
    return shlex.join(argv) if argv else ""


def _save_expert_load(path: Path, body: dict | None) -> None:
    if body is not None:
        path.write_text(json.dumps(body))


def run(scenario: str, options: Options, target: Target, out: Path, engine: str = "locust",
        grace_s: float = 60.0, plots: bool = True) -> dict:
    """Scrape /metrics (and read the expert load), run the load, scrape again, write the report into
    `out`; returns the report."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORDS_FILE).unlink(missing_ok=True)
    sc = build(scenario, options)
    meta = {"scenario": sc.describe(), "host": target.host, "model": target.model, "engine": engine,
            "label": target.label, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": _command_line()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    key = target.metrics_api_key or target.api_key
    before = prom.scrape(target.host, key)
    if before is not None:
        (out / "metrics_before.prom").write_text(before)
    _save_expert_load(out / expert_load.BEFORE_FILE, expert_load.fetch(target.host, target.api_key, time.time()))
    print(f"[loadtest] {sc.name} on {target.host} with {engine}: {len(sc.stages)} stages, "
          f"{sc.duration:.0f} s", flush=True)
    if engine == "locust":
        rc = _run_locust(sc, target, out, grace_s)
        print(f"[loadtest] locust exited with {rc} (1 = some requests failed)", flush=True)
    elif engine == "asyncio":
        from moe_serve.loadtest.async_engine import run_async

        run_async(sc, target.host, target.model, target.api_key, out / RECORDS_FILE)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    ended = time.time()
    after = prom.scrape(target.host, key)
    if after is not None:
        (out / "metrics_after.prom").write_text(after)
    _save_expert_load(out / expert_load.AFTER_FILE, expert_load.fetch(target.host, target.api_key, ended))
    report = write_report(out, plots=plots)
    print(f"[loadtest] report: {out / 'report.md'}", flush=True)
    return report
