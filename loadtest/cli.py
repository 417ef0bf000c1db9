"""`python -m moe_serve.loadtest run|ab|report|compare`: headless load tests and their reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_serve.loadtest.ab import write_ab
from moe_serve.loadtest.report import write_report
from moe_serve.loadtest.runner import Target, run
from moe_serve.loadtest.scenarios import SCENARIOS, Options


def _scenario_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=SCENARIOS, default="step")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--api-key", default="", help="bearer key for /v1/* (and /metrics unless --metrics-api-key)")
    p.add_argument("--metrics-api-key", default="")
    p.add_argument("--max-users", type=int, default=256, help="step/spike-sizes: 1, 2, 4, ... up to this")
    p.add_argument("--step-seconds", type=float, default=30.0, help="how long each stage is held")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--prompt-words", type=int, default=128, help="prompt length in random words (~tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("locust", "asyncio"), default="locust",
                   help="locust (FastHttpUser) or a small asyncio+httpx client (hosts without Locust)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", type=Path, required=True, help="output directory")


def _options(a: argparse.Namespace) -> Options:
    return Options(max_users=a.max_users, step_seconds=a.step_seconds, max_tokens=a.max_tokens,
                   prompt_words=a.prompt_words, seed=a.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_serve.loadtest", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one scenario against one server, then the report")
    r.add_argument("--host", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--label", default="")
    _scenario_args(r)
    ab = sub.add_parser("ab", help="the same scenario against two servers, then the B/A ratio table")
    ab.add_argument("--host-a", required=True)
    ab.add_argument("--host-b", required=True)
    ab.add_argument("--label-a", default="A")
    ab.add_argument("--label-b", default="B")
    _scenario_args(ab)
    rep = sub.add_parser("report", help="(re)write the report of a run directory")
    rep.add_argument("run_dir", type=Path)
    cmp_ = sub.add_parser("compare", help="ratio table of two run directories")
    cmp_.add_argument("dir_a", type=Path)
    cmp_.add_argument("dir_b", type=Path)
    cmp_.add_argument("--out", type=Path, required=True)
    cmp_.add_argument("--label-a", default="A")
    cmp_.add_argument("--label-b", default="B")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "run":
        t = Target(a.host, a.model, a.api_key, a.metrics_api_key, a.label)
        report = run(a.scenario, _options(a), t, a.out, a.engine, plots=not a.no_plots)
        print((a.out / "report.md").read_text(), flush=True)
        return 1 if report["totals"]["errors"] else 0
    if a.cmd == "ab":
        errors = 0
        for host, label, sub in ((a.host_a, a.label_a, "A"), (a.host_b, a.label_b, "B")):
            t = Target(host, a.model, a.api_key, a.metrics_api_key, label)
            errors += run(a.scenario, _options(a), t, a.out / sub, a.engine, plots=not a.no_plots)["totals"]["errors"]
        write_ab(a.out / "A", a.out / "B", a.out, a.label_a, a.label_b)
        print((a.out / "ab.md").read_text(), flush=True)
        return 1 if errors else 0
    if a.cmd == "report":
        write_report(a.run_dir)
        print((a.run_dir / "report.md").read_text(), flush=True)
        return 0
    write_ab(a.dir_a, a.dir_b, a.out, a.label_a, a.label_b)
    print((a.out / "ab.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
