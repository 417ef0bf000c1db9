"""The fixed-batch decode A/B harness: run order, resume, statistics, and one real probe process
on the vLLM CPU engine with the embedded model."""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import decode_ab  # noqa: E402
import decode_stats  # noqa: E402
from dummy_model import dummy_model_dir  # noqa: E402


def test_rounds_run_each_variant_once_per_round_in_every_position():
    variants = ["stock", "vllm-triton", "moe-serve"]
    plan = decode_ab.rounds(variants, 6)
    assert len(plan) == 18
    for r in range(6):
        assert sorted(v for rr, v in plan if rr == r) == sorted(variants)
    positions = Counter((i % 3, v) for i, (_, v) in enumerate(plan))
    assert set(positions.values()) == {2}          # 6 rounds / 3 positions, for every variant


def _run(variant: str, rnd: int, tok_s: dict[int, float]) -> dict:
    return {"variant": variant, "round": rnd, "prompts": "distinct", "temperature": 1.0,
            "rows": [{"B": b, "tok_s": t, "step_ms": b / t * 1e3} for b, t in tok_s.items()]}


def _write_runs(d: Path, gain: float, noise: float, n: int, seed: int = 0) -> dict[str, list[float]]:
    rng = random.Random(seed)
    raw: dict[str, list[float]] = {"stock": [], "moe-serve": []}
    for r in range(n):
        for v, g in (("stock", 1.0), ("moe-serve", gain)):
            t = 400.0 * g * math.exp(rng.gauss(0, noise))
            raw[v].append(t)
            (d / f"run-r{r}-{v}.json").write_text(json.dumps(_run(v, r, {1: t, 8: 6 * t})))
    return raw


def test_stats_ratio_is_the_geomean_ratio_and_the_ci_resolves_a_clear_gain(tmp_path):
    raw = _write_runs(tmp_path, gain=1.10, noise=0.01, n=6)
    rows = decode_stats.summarize(decode_stats.load_runs([tmp_path]), "stock")
    cell = next(r for r in rows if r["B"] == "1")
    exact = math.exp(sum(map(math.log, raw["moe-serve"])) / 6 - sum(map(math.log, raw["stock"])) / 6)
    assert cell["ratio"] == pytest.approx(exact, rel=1e-12)
    assert (cell["n"], cell["n_base"]) == (6, 6)
    assert 1.0 < cell["lo"] < cell["ratio"] < cell["hi"] < 1.2
    assert [r["B"] for r in rows] == ["1", "8", "all"]


def test_stats_ci_covers_one_when_process_noise_swamps_the_gain(tmp_path):
    _write_runs(tmp_path, gain=1.03, noise=0.15, n=3, seed=3)
    cell = decode_stats.summarize(decode_stats.load_runs([tmp_path]), "stock")[0]
    assert cell["lo"] < 1.0 < cell["hi"]


def test_stats_needs_two_processes_per_side_for_an_interval(tmp_path):
    _write_runs(tmp_path, gain=1.1, noise=0.01, n=1)
    cell = decode_stats.summarize(decode_stats.load_runs([tmp_path]), "stock")[0]
    assert cell["lo"] is None and cell["hi"] is None and cell["ratio"] > 1.0
    assert "n/a" in decode_stats.markdown([cell], "stock")[2]


def test_decode_ab_resumes_without_rerunning_finished_runs(tmp_path):
    for r in range(2):
        for v in ("stock", "moe-serve"):
            (tmp_path / f"run-r{r}-{v}.json").write_text(json.dumps(_run(v, r, {1: 100.0})))
    model = tmp_path / "model"
    model.mkdir()
    # every run is done: no probe process may start (one would fail on this empty model dir)
    assert decode_ab.main(["--model", str(model), "--processes", "2", "--out", str(tmp_path),
                           "--probe-timeout-s", "5"]) == 0


def test_decode_ab_starts_no_process_the_budget_cannot_hold(tmp_path, capsys):
    (tmp_path / "run-r0-stock.json").write_text(json.dumps(_run("stock", 0, {1: 100.0})))
    model = tmp_path / "model"
    model.mkdir()
    # one run to go, 200 s of budget, a cold start expected to take 300 s: stop, resumable (3)
    assert decode_ab.main(["--model", str(model), "--processes", "1", "--out", str(tmp_path),
                           "--budget-s", "200", "--expect-run-s", "300"]) == 3
    assert "s left < 300 s per run; stopping" in capsys.readouterr().out
    assert not (tmp_path / "run-r0-moe-serve.log").exists()


def test_decode_ab_without_a_budget_runs_every_process(tmp_path, monkeypatch):
    import socket

    # a slow first process on this host (600 s): with no --budget-s nothing may stop the A/B
    (tmp_path / "run-r0-stock.json").write_text(json.dumps(
        {**_run("stock", 0, {1: 100.0}), "host": socket.gethostname(), "ended": 1.0, "wall_s": 600.0}))
    model = tmp_path / "model"
    model.mkdir()
    calls = []

    def fake_run_one(model, variant, rnd, a, profile=False):
        calls.append((rnd, variant))
        (a.out / f"run-r{rnd}-{variant}.json").write_text(json.dumps(_run(variant, rnd, {1: 100.0})))
        return 1.0

    monkeypatch.setattr(decode_ab, "run_one", fake_run_one)
    assert decode_ab.main(["--model", str(model), "--processes", "2", "--out", str(tmp_path)]) == 0
    assert calls == [(0, "moe-serve"), (1, "moe-serve"), (1, "stock")]


def test_dummy_model_dir_writes_a_static_fp8_checkpoint_config(tmp_path):
    d = dummy_model_dir("mixtral-8x7b-tp8-rank", tmp_path, quantization="fp8-static")
    cfg = json.loads((d / "config.json").read_text())
    assert d.name == "mixtral-8x7b-tp8-rank-fp8-static"
    assert cfg["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "static"}
    assert (d / "tokenizer.json").is_file()


def _probe(tmp_path: Path, model: Path, name: str, *extra: str) -> dict:
    """One decode_probe.py process on the CPU engine: B = 1, 3, 2 and 12 tokens, one repetition."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_probe.py"), "--model",
                           str(model), "--variant", "stock", "--batches", "1,3",
                           "--short", "2", "--long", "12", "--reps", "1", "--prompt-len", "16",
                           *extra, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_probe_measures_and_profiles_decode_on_the_real_cpu_engine(tmp_path, embedded_model_dir):
    import decode_profile

    traces = tmp_path / "traces"
    res = _probe(tmp_path, embedded_model_dir, "run", "--profile", "--keep-traces", str(traces))
    assert res["variant"] == "stock" and res["env"] == {"VLLM_PLUGINS": ""}
    assert (res["prompts"], res["temperature"]) == ("distinct", 1.0)
    assert [r["B"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert r["step_ms"] > 0 and r["tok_s"] == pytest.approx(r["B"] / r["step_ms"] * 1e3)
        assert r["distinct_outputs"] == r["B"]       # the B sequences differ, so their routing can
    # the profile: one trace per (B, short/long) from vLLM's torch profiler; a CPU engine runs no
    # GPU kernels, so the summaries are empty, and the kept traces' CPU ops show what was recorded
    assert "profile_error" not in res
    assert sorted(res["profile"]) == ["1", "3"]
    for b in ("1", "3"):
        p = res["profile"][b]
        assert p["tokens"] == [2, 12] and p["short"]["kernels"] == {} and p["short"]["busy_us"] == 0
    kept = sorted(t.name for t in traces.iterdir())
    assert kept == [f"B{b}-{n}.pt.trace.json.gz" for b in (1, 3) for n in ("long", "short")]
    short, long_ = (decode_profile.summarize_trace(traces / f"B3-{n}.pt.trace.json.gz", ("cpu_op",))
                    for n in ("short", "long"))
    assert 0 < short["busy_us"] <= short["span_us"] and long_["busy_us"] > short["busy_us"]
    assert sum(c for c, _ in long_["kernels"].values()) > sum(c for c, _ in short["kernels"].values())


def test_probe_same_prompt_greedy_decodes_identical_sequences(tmp_path, embedded_model_dir):
    res = _probe(tmp_path, embedded_model_dir, "same", "--prompts", "same", "--temperature", "0")
    assert [r["distinct_outputs"] for r in res["rows"]] == [1, 1]


def test_runs_of_different_workloads_are_not_pooled(tmp_path):
    _write_runs(tmp_path, gain=1.1, noise=0.01, n=2)
    legacy = {k: v for k, v in _run("stock", 2, {1: 100.0}).items() if k not in ("prompts", "temperature")}
    assert decode_stats.workload(legacy) == ("same", 0.0)       # runs from before the options
    (tmp_path / "run-r2-stock.json").write_text(json.dumps(legacy))
    with pytest.raises(SystemExit, match="different workloads"):
        decode_stats.load_runs([tmp_path])


def test_decode_ab_will_not_resume_a_dir_of_another_workload(tmp_path, capsys):
    (tmp_path / "run-r0-stock.json").write_text(json.dumps({**_run("stock", 0, {1: 100.0}), "temperature": 0.0}))
    model = tmp_path / "model"
    model.mkdir()
    assert decode_ab.main(["--model", str(model), "--processes", "1", "--out", str(tmp_path)]) == 2
    assert "another workload" in capsys.readouterr().out
    assert not (tmp_path / "run-r0-moe-serve.log").exists()


def test_decode_ab_expects_a_variants_last_two_runs_on_this_host(tmp_path, capsys):
    import socket

    here, other = socket.gethostname(), socket.gethostname() + "-other"
    for r, (host, ended, wall) in enumerate([(here, 1.0, 290.0), (here, 2.0, 95.0), (here, 3.0, 110.0),
                                              (other, 4.0, 400.0)]):
        (tmp_path / f"run-r{r}-stock.json").write_text(json.dumps(
            {**_run("stock", r, {1: 100.0}), "host": host, "ended": ended, "wall_s": wall}))
    # the first (cold) run here and the other host's run do not count: the last two here do
    assert decode_ab.expected_walls(tmp_path) == {"stock": 110.0}
    model = tmp_path / "model"
    model.mkdir()
    assert decode_ab.main(["--model", str(model), "--variants", "stock", "--processes", "5",
                           "--out", str(tmp_path), "--budget-s", "100", "--expect-run-s", "10"]) == 3
    assert "s left < 110 s per run; stopping" in capsys.readouterr().out


def test_decode_ab_profiles_one_process_per_variant(tmp_path, monkeypatch):
    (tmp_path / "run-r0-stock.json").write_text(json.dumps({**_run("stock", 0, {1: 100.0}), "profile": {"1": {}}}))
    (tmp_path / "run-r0-moe-serve.json").write_text(json.dumps(_run("moe-serve", 0, {1: 100.0})))
    model = tmp_path / "model"
    model.mkdir()
    calls = []

    def fake_run_one(model, variant, rnd, a, profile=False):
        calls.append((rnd, variant, profile))
        extra = {"profile": {"1": {}}} if profile else {}
        (a.out / f"run-r{rnd}-{variant}.json").write_text(json.dumps({**_run(variant, rnd, {1: 100.0}), **extra}))
        return 1.0

    monkeypatch.setattr(decode_ab, "run_one", fake_run_one)
    assert decode_ab.main(["--model", str(model), "--processes", "3", "--out", str(tmp_path), "--profile"]) == 0
    # stock was profiled in round 0 already; moe-serve's first process here profiles, no later one
    assert calls == [(1, "moe-serve", True), (1, "stock", False), (2, "stock", False), (2, "moe-serve", False)]


def test_decode_ab_forwards_the_probe_workload_it_was_given():
    import argparse

    import decode_probe

    a = decode_ab.parse_args(["--out", "x", "--batches", "1,4", "--prompts", "same", "--temperature", "0",
                              "--prompt-len", "64", "--gpu-memory-utilization", "0.8"])
    probe = argparse.ArgumentParser()
    decode_probe.add_workload_args(probe)
    got = vars(probe.parse_args(decode_probe.workload_argv(a)))
    assert got == {k: getattr(a, k) for k in decode_probe.WORKLOAD_ARGS}
    assert (got["batches"], got["prompts"], got["temperature"], got["prompt_len"]) == ("1,4", "same", 0.0, 64)
