"""The report of one run directory: report.json, report.md and the PNG plots.

A run directory holds meta.json (scenario, target, engine), requests.jsonl (one record per
request), metrics_before.prom / metrics_after.prom (when /metrics could be read) and
expert_load_before.json / expert_load_after.json (when the server has GET /v1/moe/expert-load).
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_serve.loadtest import expert_load, prom
from moe_serve.loadtest.records import RECORDS_FILE, read_records
from moe_serve.loadtest.scenarios import Stage
from moe_serve.loadtest.stats import all_stages, error_samples

COLUMNS = (("users", "users", "{}"), ("requests", "requests", "{}"), ("errors", "errors", "{}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"), ("TTFT p90 ms", "ttft_p90_ms", "{:.1f}"),
           ("TTFT p99 ms", "ttft_p99_ms", "{:.1f}"), ("ITL p50 ms", "itl_p50_ms", "{:.2f}"),
           ("ITL p99 ms", "itl_p99_ms", "{:.2f}"), ("output tok/s", "output_tok_s", "{:.1f}"),
           ("req/s", "req_s", "{:.2f}"))


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _read_text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _read_json(path: Path) -> dict | None:
    text = _read_text(path)
    return json.loads(text) if text else None


def build_report(run_dir: Path) -> dict:
    """Compute the report dict of `run_dir` from its records (no files written)."""
    meta = json.loads((run_dir / "meta.json").read_text())
    records = read_records(run_dir / RECORDS_FILE) if (run_dir / RECORDS_FILE).is_file() else []
    stages_def = meta["scenario"]["stages"]
    stages = all_stages([Stage(**s) for s in stages_def], records)
    for row, st in zip(stages, stages_def):
        row["start"] = st["start"]
    compiles = prom.compiles_delta(_read_text(run_dir / "metrics_before.prom"), _read_text(run_dir / "metrics_after.prom"))
    load = expert_load.run_load(_read_json(run_dir / expert_load.BEFORE_FILE),
                                _read_json(run_dir / expert_load.AFTER_FILE))
    return {"meta": meta, "stages": stages, "serving_jit_compiles": compiles, "expert_load": load,
            "totals": {"requests": sum(s["requests"] for s in stages), "errors": sum(s["errors"] for s in stages),
                       "cancelled": sum(r.status == "cancelled" for r in records)},
            "error_samples": error_samples(records)}


def compiles_text(compiles: dict | None) -> str:
    if compiles is None:
        return "n/a (the server does not export moe_serve_triton_jit_compiles_total)"
    per = ", ".join(f"{k}: {v:g}" for k, v in sorted(compiles["per_kernel"].items())) or "none"
    return f"{compiles['total']:g} ({per})"


def markdown(report: dict) -> str:
    """The report as markdown: header, per-stage table, compiles, errors, plots."""
    m = report["meta"]
    sc = m["scenario"]
    lines = [f"# Load test: `{sc['name']}` against {m['host']}", "",
             f"- model `{m['model']}`, engine {m['engine']}, started {m['started']}",
             f"- options: {', '.join(f'{k}={v}' for k, v in sc['options'].items())}",
             f"- command: `{m.get('command', '')}`",
             f"- serving-phase Triton JIT compiles during the run: {compiles_text(report['serving_jit_compiles'])}",
             f"- totals: {report['totals']['requests']} ok requests, {report['totals']['errors']} errors, "
             f"{report['totals']['cancelled']} cut off at stage ends (throughput only)", "",
             "| stage | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for s in report["stages"]:
        lines.append(f"| {s['label']} | " + " | ".join(fmt(s[key], spec) for _, key, spec in COLUMNS) + " |")
    lines += ["", "TTFT: send to first non-empty content chunk. ITL: per request, (last - first content chunk) / "
              "(output tokens - 1); percentiles over requests. Latencies: requests started in the stage. "
              "Output tok/s: tokens generated inside the stage's window.", ""]
    lines += [*expert_load.markdown_lines(report.get("expert_load")), ""]
    if report["error_samples"]:
        lines += ["Errors seen:", ""] + [f"- `{e}`" for e in report["error_samples"]] + [""]
    lines += [f"![{p}]({p})" for p in ("ttft_vs_users.png", "throughput_vs_users.png", "latency_over_time.png")]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, plots: bool = True) -> dict:
    """Build and write report.json, report.md (and the PNGs) into `run_dir`."""
    run_dir = Path(run_dir)
    report = build_report(run_dir)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    (run_dir / "report.md").write_text(markdown(report))
    if plots:
        from moe_serve.loadtest.plots import write_plots  # matplotlib only when plotting

        records = read_records(run_dir / RECORDS_FILE) if (run_dir / RECORDS_FILE).is_file() else []
        title = f"{report['meta']['scenario']['name']} @ {report['meta'].get('label') or report['meta']['host']}"
        write_plots(records, report["stages"], title, run_dir)
    return report
