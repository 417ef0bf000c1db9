"""Every scenario, headless, against the real server (vLLM CPU engine, embedded model).

Checks: no failures, non-empty Locust CSVs, the report's per-stage numbers equal Locust's
(counts exactly; percentiles after Locust's own rounding; means to float precision), fixed
output lengths, valid PNGs. The asyncio engine and the A/B mode run too.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from moe_serve.loadtest.cli import main as cli_main
from moe_serve.loadtest.plots import PLOTS
from moe_serve.loadtest.runner import Target, run
from moe_serve.loadtest.scenarios import Options
from tests.conftest import API_KEY
from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.engine
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SHORT = dict(max_tokens=8, prompt_words=16)
CASES = {  # scenario -> options: seconds each, small user counts
    "step": Options(max_users=4, step_seconds=2.0, **SHORT),
    "mixed": Options(max_users=3, step_seconds=1.0, **SHORT),
    "burst": Options(max_users=4, step_seconds=1.5, **SHORT),
    "spike-sizes": Options(max_users=2, step_seconds=2.0, **SHORT),
}


def locust_buckets(values: list[float]) -> list[int]:
    """Locust's rounding of response times (computed in a subprocess: importing locust here
    would gevent-monkey-patch the pytest process)."""
    code = ("import json, sys; from locust.stats import bucket_response_time as b; "
            "print(json.dumps([b(v) for v in json.loads(sys.stdin.read())]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(values), capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_stats_csv(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(path, newline="") as fh:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(fh)}


def check_pngs(run_dir: Path) -> None:
    for name in PLOTS:
        data = (run_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(run_dir / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name


def check_against_csv(report: dict, stats: dict) -> None:
    """Per active stage: the report's numbers are Locust's numbers."""
    to_bucket, expected = [], []
    for s in report["stages"]:
        tag = f"s{s['stage']:02d}"
        http = [row for (typ, name), row in stats.items() if typ == "POST" and name.endswith(" " + tag)]
        http_count = sum(int(r["Request Count"]) for r in http)
        assert sum(int(r["Failure Count"]) for r in http) == s["errors"] == 0
        if s["users"] == 0:
            assert s["requests"] == 0 and http_count == 0 and ("METRIC", f"ttft {tag}") not in stats
            continue
        assert s["requests"] > 0
        ttft, itl, e2e = (stats[("METRIC", f"{m} {tag}")] for m in ("ttft", "itl", "e2e"))
        assert s["requests"] == int(e2e["Request Count"]) == int(ttft["Request Count"]) == http_count
        assert s["output_tokens"] == pytest.approx(float(e2e["Average Content Size"]) * s["requests"])
        assert s["ttft_mean_ms"] == pytest.approx(float(ttft["Average Response Time"]), rel=1e-9)
        assert s["itl_mean_ms"] == pytest.approx(float(itl["Average Response Time"]), rel=1e-9)
        for key, row, col in (("ttft_p50_ms", ttft, "50%"), ("ttft_p90_ms", ttft, "90%"),
                              ("ttft_p99_ms", ttft, "99%"), ("itl_p50_ms", itl, "50%"), ("itl_p99_ms", itl, "99%")):
            to_bucket.append(s[key])
            expected.append((key, tag, int(float(row[col]))))
    assert [b for b in locust_buckets(to_bucket)] == [e[2] for e in expected], expected


def check_records(run_dir: Path, report: dict) -> None:
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    ok = [r for r in records if r["status"] == "ok"]
    assert ok and all(r["output_tokens"] == r["max_tokens"] for r in ok)  # ignore_eos + max_tokens
    assert not [r for r in records if r["status"] == "error"]
    # every token generated before the end is counted once in some stage's window
    total = sum(r["output_tokens"] for r in records)
    counted = sum(s["output_tok_s"] * s["seconds"] for s in report["stages"])
    assert 0.8 * total <= counted <= total + 1e-6


@pytest.mark.parametrize("scenario", list(CASES))
def test_scenario_with_locust(server: ServerProcess, scenario: str, tmp_path: Path) -> None:
    report = run(scenario, CASES[scenario], Target(server.base_url, MODEL_NAME, API_KEY), tmp_path)
    stats_csv = tmp_path / "locust_stats.csv"
    assert stats_csv.stat().st_size > 0 and (tmp_path / "locust_stats_history.csv").stat().st_size > 0
    assert report["totals"]["errors"] == 0, report["error_samples"]
    check_against_csv(report, read_stats_csv(stats_csv))
    check_records(tmp_path, report)
    check_pngs(tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["stages"] == report["stages"]
    md = (tmp_path / "report.md").read_text()
    assert all(f"| {s['label']} | {s['users']} | {s['requests']} | 0 |" in md for s in report["stages"])


def test_step_with_asyncio_engine(server: ServerProcess, tmp_path: Path) -> None:
    report = run("step", CASES["step"], Target(server.base_url, MODEL_NAME, API_KEY), tmp_path, engine="asyncio")
    assert [s["users"] for s in report["stages"]] == [1, 2, 4]
    assert all(s["requests"] > 0 and s["output_tok_s"] > 0 for s in report["stages"])
    check_records(tmp_path, report)
    check_pngs(tmp_path)
    # the run's expert load, beside its latencies: every finished request ran at least its output
    # tokens through each MoE layer (prompt tokens may come from the prefix cache)
    load = report["expert_load"]
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    generated = sum(r["output_tokens"] for r in records if r["status"] == "ok")
    assert [r["layer"] for r in load["layers"]] == [0, 1] and not load["restarted"]
    assert all(r["tokens"] >= generated > 0 and r["imbalance"] >= 1.0 for r in load["layers"]), (load, generated)
    assert "| layer | experts | top-k | tokens | imbalance |" in (tmp_path / "report.md").read_text()


def test_ab_mode_ratios(server: ServerProcess, tmp_path: Path) -> None:
    rc = cli_main(["ab", "--host-a", server.base_url, "--host-b", server.base_url, "--label-a", "one",
                   "--label-b", "two", "--model", MODEL_NAME, "--api-key", API_KEY, "--scenario", "step",
                   "--max-users", "2", "--step-seconds", "1", "--max-tokens", "8", "--prompt-words", "8",
                   "--engine", "asyncio", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    ab = json.loads((tmp_path / "ab.json").read_text())
    a, b = (json.loads((tmp_path / x / "report.json").read_text()) for x in ("A", "B"))
    assert [r["users"] for r in ab["rows"]] == [1, 2]
    for row, sa, sb in zip(ab["rows"], a["stages"], b["stages"]):
        assert row["output_tok_s_ratio"] == pytest.approx(sb["output_tok_s"] / sa["output_tok_s"])
        assert row["ttft_p50_ms_ratio"] == pytest.approx(sb["ttft_p50_ms"] / sa["ttft_p50_ms"])
    assert "B/A" in (tmp_path / "ab.md").read_text()
