"""The yardstick's run record and what may be published from it: vLLM's MoE table for the baseline
(bench/serve/baseline_table.py, checked against vLLM's own file naming), the environment record
(run_env.py), `moe-serve bench serve verify` (verify.py), processes outside their variant's spread
(spread.py) and the headline's cells and their bar (headline.py)."""
from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import pytest

from moe_serve.bench import stats as bench_stats
from moe_serve.bench import tables
from moe_serve.bench.serve import ab_tables, baseline_table, headline, run_env, spread, verify
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve.servers import BASELINE, OURS

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
QWEN3 = json.loads((MODELS / "qwen3-30b-a3b" / "config.json").read_text())
QWEN3_FP8 = json.loads((MODELS / "qwen3-30b-a3b-fp8-block" / "config.json").read_text())
BF16_H100 = "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json"
DEFAULT_LINE = ("(EngineCore pid=1) WARNING 12-06 09:45:01 [fused_moe.py:1107] Using default MoE config. Performance "
                "might be sub-optimal! Config file not found at {}\n")
LOADED_LINE = "(EngineCore pid=1) INFO 12-06 09:45:01 [fused_moe.py:1094] Using configuration from {} for MoE layer.\n"


# --- vLLM's table for the baseline ---------------------------------------------------------------

@pytest.mark.parametrize("device", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200", "NVIDIA_H200_NVL", "AMD_Instinct_MI300X"])
def test_the_table_name_is_vllms_own_for_any_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.fused_moe import fused_moe
    from vllm.platforms import current_platform
    from vllm.utils.platform_utils import get_device_name_as_file_name

    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: device.replace("_", " "))
    named = get_device_name_as_file_name.__wrapped__()         # vLLM caches the first GPU's name
    assert baseline_table.device_file_name(device.replace("_", " ")) == named == device
    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda: named)
    for shape in ((128, 768, None, None), (128, 768, "fp8_w8a8", [128, 128]), (8, 14336, "fp8_w8a8", None)):
        assert baseline_table.table_name(*shape, device) == fused_moe.get_config_file_name(*shape)


def test_the_expected_table_is_looked_up_as_vllm_does(tmp_path: Path) -> None:
    """The tuned folder first, then the shipped tables, else vLLM's default; per format."""
    shipped, tuned = tmp_path / "shipped", tmp_path / "tuned"
    for folder, names in ((shipped, ["E=128,N=768,device_name=NVIDIA_H200.json"]), (tuned, [BF16_H100])):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(json.dumps({"1": {"BLOCK_SIZE_M": 16}, "folder": folder.name}))
    got = baseline_table.expected(QWEN3, 1, H100, tuned, shipped)
    assert got == {"device_name": "NVIDIA_H100_80GB_HBM3", "tables": [
        {"file": BF16_H100, "source": "tuned", "path": str(tuned / BF16_H100),
         "sha256": hashlib.sha256((tuned / BF16_H100).read_bytes()).hexdigest()}]}
    assert baseline_table.expected(QWEN3, 1, H200, tuned, shipped)["tables"][0]["source"] == "shipped"
    (tuned / "E=128,N=768,device_name=NVIDIA_H200.json").write_text("{}")
    assert baseline_table.expected(QWEN3, 1, "NVIDIA H200 NVL", tuned, shipped)["tables"][0]["source"] == "tuned"
    fp8 = baseline_table.expected(QWEN3_FP8, 1, H100, tuned, shipped)["tables"]
    assert fp8 == [{"file": "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128,128].json",
                    "source": "default", "path": None, "sha256": None}]
    assert baseline_table.expected(QWEN3, 4, H100, None, shipped)["tables"][0]["file"].startswith("E=128,N=192,")
    assert "untuned" in baseline_table.label([{"tables": fp8}])
    # this host's vLLM ships the H200 table for Qwen3-30B-A3B and none for the H100
    real = baseline_table.shipped_dir()
    assert real is not None and baseline_table.expected(QWEN3, 1, H200, None, real)["tables"][0]["source"] == "shipped"
    assert baseline_table.expected(QWEN3, 1, H100, None, real)["tables"][0]["source"] == "default"


def test_the_log_is_the_evidence_of_the_table_vllm_loaded(tmp_path: Path) -> None:
    path = tmp_path / BF16_H100
    tuned = {"tables": [{"file": BF16_H100, "source": "tuned", "path": str(path), "sha256": "ab"}]}
    default = {"tables": [{"file": BF16_H100, "source": "default", "path": None, "sha256": None}]}
    loaded = baseline_table.logged(LOADED_LINE.format(path) * 2 + "other line\n")
    missed = baseline_table.logged(DEFAULT_LINE.format(f"{tmp_path}/{BF16_H100}, /site/configs/{BF16_H100}"))
    assert loaded == {"loaded": [str(path)], "default": [], "lines": [LOADED_LINE.format(path).strip()]}
    assert missed["loaded"] == [] and missed["lines"][0].endswith(f"/site/configs/{BF16_H100}")
    assert missed["default"] == sorted([f"{tmp_path}/{BF16_H100}", f"/site/configs/{BF16_H100}"])
    assert baseline_table.disagreement(tuned, loaded, H100, "TRITON") is None
    assert baseline_table.disagreement(default, missed, H100, "TRITON") is None
    assert "nothing loaded" in baseline_table.disagreement(tuned, missed, H100, "TRITON")
    assert "recorded as default, but the log says vLLM loaded" in baseline_table.disagreement(default, loaded, H100, None)
    nothing = baseline_table.logged("")
    assert "no 'Using default MoE config' line" in baseline_table.disagreement(default, nothing, H100, "TRITON")
    assert baseline_table.disagreement(default, nothing, "cpu", "CPU") is None           # no Triton MoE ran
    assert baseline_table.disagreement(default, nothing, H100, "DEEPGEMM") is None       # a backend with no table
    stray = baseline_table.logged(LOADED_LINE.format("/x/E=8,N=1,device_name=cpu.json"))
    assert "E=8,N=1,device_name=cpu.json" in baseline_table.disagreement(default, stray, "cpu", "CPU")


# --- the environment record ------------------------------------------------------------------------

def test_the_environment_record_keeps_what_decides_a_run_and_no_secret(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / BF16_H100).write_text("{}")
    monkeypatch.setenv(run_env.TUNED_ENV, str(tmp_path))
    monkeypatch.setenv("MOE_SERVE_API_KEY", "secret")
    monkeypatch.setenv("MOE_SERVE_RUNTIME_DIR", "/tmp/x")
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("HOME_OTHER", "1")
    rec = run_env.record({"VLLM_PLUGINS": "", run_env.ROUTING_ENV: ""},
                         ["--model", "m", "--additional-config", '{"moe_serve": {"fused_router": false}}'])
    env = rec["env"]
    assert env["VLLM_PLUGINS"] == "" and env[run_env.TUNED_ENV] == str(tmp_path) and env[run_env.ROUTING_ENV] == ""
    assert not {"MOE_SERVE_API_KEY", "MOE_SERVE_RUNTIME_DIR", "HOME_OTHER"} & set(env)
    assert "secret" not in json.dumps(rec)
    assert rec["folders"] == {run_env.TUNED_ENV: {BF16_H100: hashlib.sha256(b"{}").hexdigest()},
                              run_env.KERNEL_TABLES_ENV: None}
    assert rec["additional_config"] == {"moe_serve": {"fused_router": False}}
    assert run_env.additional_config(["--engine-arg", 'additional_config={"a": 1}']) == {"a": 1}
    other = run_env.record({run_env.ROUTING_ENV: "uniform_random"}, [])
    assert run_env.shared_differences({"a/r0": rec, "b/r0": rec}) == []
    assert run_env.shared_differences({"a/r0": rec, "b/r0": other}) == [f"b/r0 vs a/r0: {run_env.ROUTING_ENV}"]


# --- processes, verify -----------------------------------------------------------------------------

def _rec(level: int, index: int, gap_us: float, tokens: int = 8) -> dict:
    return {"level": level, "phase": "measured", "index": index, "status": "ok", "error": None, "t_start": index * 0.1,
            "t_end": index * 0.1 + 0.01 + (tokens - 1) * gap_us / 1e6, "ttft": 0.01, "output_tokens": tokens,
            "chunks": tokens, "itl_us": [gap_us] * (tokens - 1)}


def _process(run: Path, variant: str, rnd: int, gap_us: float, levels: tuple[int, ...] = (1,), requests: int = 4,
             log: str | None = None, **meta: object) -> Path:
    d = run / variant / f"r{rnd}"
    d.mkdir(parents=True)
    table = {"device_name": "NVIDIA_H100_80GB_HBM3",
             "tables": [{"file": BF16_H100, "source": "default", "path": None, "sha256": None}]}
    env = run_env.record({"VLLM_PLUGINS": ""} if variant == BASELINE else {}, [])
    full = {"variant": variant, "round": rnd, "host": "h", "gpu": H100, "driver": "570.86.15", "vllm": "0.26.0",
            "torch": "2.11.0", "triton": "3.6.0", "commit": "c" * 40, "dirty": False, "source_sha256": "d" * 64,
            "workload": {"model": "qwen3-30b-a3b", "config_sha256": "x", "levels": list(levels), "prompt_tokens": 8,
                         "output_tokens": 8, "engine": {"tensor_parallel_size": 1}},
            "requests_per_level": {str(c): requests for c in levels}, "copy_ceiling_bps": None,
            "environment": env, "vllm_moe_table": table, "backends": {"moe": "TRITON"}, **meta}
    (d / "meta.json").write_text(json.dumps(full))
    (d / "requests.jsonl").write_text("\n".join(json.dumps(_rec(c, i, gap_us)) for c in levels for i in range(requests)))
    if log is not None:
        (d / "server.log.xz").write_bytes(lzma.compress(log.encode()))
    (d / serve_stats.COMPLETE).write_text("{}")
    return d


CACHE = {"c" * 40: "d" * 64}        # the named commit's digest, as verify would compute it from git


def test_verify_passes_a_complete_record_and_names_each_failure(tmp_path: Path) -> None:
    miss = DEFAULT_LINE.format(f"/site/configs/{BF16_H100}")
    good = _process(tmp_path, BASELINE, 0, 4000, log=miss)
    meta = json.loads((good / "meta.json").read_text())
    assert verify.problems(good, meta, dict(CACHE)) == []
    cases = {"dirty": {"dirty": True}, "source: differs": {"source_sha256": "e" * 64},
             "not recorded: driver": {"driver": None}, "no environment recorded": {"environment": None},
             "VLLM_PLUGINS=None": {"environment": run_env.record({}, [])},
             "no vLLM MoE table recorded": {"vllm_moe_table": None}}
    for i, (want, change) in enumerate(cases.items()):
        d = _process(tmp_path / f"case{i}", BASELINE, 0, 4000, log=miss, **change)
        got = verify.problems(d, json.loads((d / "meta.json").read_text()), dict(CACHE))
        assert any(want in g for g in got), (want, got)
    loaded = _process(tmp_path / "loaded", BASELINE, 0, 4000, log=LOADED_LINE.format(f"/site/configs/{BF16_H100}"))
    assert "the log says vLLM loaded" in verify.problems(loaded, json.loads((loaded / "meta.json").read_text()),
                                                         dict(CACHE))[0]
    short = _process(tmp_path / "short", BASELINE, 0, 4000, log=miss, requests_per_level={"1": 5})
    assert verify.problems(short, json.loads((short / "meta.json").read_text()), dict(CACHE)) == [
        "c = 1: 4 of 4 timed requests answered, 5 planned"]
    ours = _process(tmp_path / "ours", OURS, 0, 3000)             # moe-serve: no log line is due
    assert verify.problems(ours, json.loads((ours / "meta.json").read_text()), dict(CACHE)) == []


def test_verify_checks_the_run_shares_its_environment(tmp_path: Path) -> None:
    a = json.loads((_process(tmp_path, BASELINE, 0, 4000) / "meta.json").read_text())
    b = {**a, "environment": run_env.record({run_env.ROUTING_ENV: "uniform_random"}, [])}
    c = {**a, "vllm_moe_table": {"device_name": "x", "tables": []}}
    assert verify.run_problems({"vllm-serve/r0": a, "moe-serve/r0": a}) == []
    assert verify.run_problems({"vllm-serve/r0": a, "moe-serve/r0": b}) == [
        f"vllm-serve/r0 vs moe-serve/r0: {run_env.ROUTING_ENV}"]
    assert verify.run_problems({"vllm-serve/r0": a, "moe-serve/r0": c}) == ["2 different vLLM MoE table records"]
    old = {k: v for k, v in a.items() if k not in ("environment", "vllm_moe_table")}    # a run before the record
    assert verify.run_problems({"vllm-serve/r0": old}) == ["no process recorded its environment"]


# --- spread, headline cells -------------------------------------------------------------------------

def test_a_process_outside_the_others_spread_is_flagged() -> None:
    assert bench_stats.outlier([842.8, 690.6, 830.5]) == 1          # the stalled baseline process of issue #56
    assert bench_stats.outlier([3.647, 3.665, 3.665]) is None        # 0.5 %: within the 2 % floor
    assert bench_stats.outlier([100.0, 103.0, 106.0]) is None        # evenly spread: none outside the others
    assert bench_stats.outlier([100.0, 130.0]) is None               # two: which one is off cannot be told
    assert bench_stats.outlier([100.0, 101.0, 150.0, 102.0]) == 2
    assert bench_stats.wider_than({"lo": 1.0, "hi": 1.03}) and not bench_stats.wider_than({"lo": 1.0, "hi": 1.01})


def test_the_ratio_is_shown_with_and_without_a_flagged_process(tmp_path: Path) -> None:
    for r, gap in enumerate((4000, 4010, 5000)):                     # baseline r2 stalls
        _process(tmp_path, BASELINE, r, gap)
    for r in range(3):
        _process(tmp_path, OURS, r, 3000 + 10 * r)
    procs = serve_stats.load([tmp_path])
    (flag,) = [f for f in spread.flags(procs) if f.metric == "itl_p50_ms"]
    assert (flag.variant, flag.round, flag.value, flag.others) == (BASELINE, 2, 5.0, (4.0, 4.01))
    ((variant, with_it, without),) = spread.with_and_without(procs, flag, BASELINE, (BASELINE, OURS))
    assert variant == OURS and (with_it["n"], with_it["n_base"], without["n"], without["n_base"]) == (3, 3, 3, 2)
    assert without["ratio"] == pytest.approx((4.0 * 4.01) ** 0.5 / (3.0 * 3.01 * 3.02) ** (1 / 3), rel=1e-6)
    assert without["ratio"] < with_it["ratio"]
    text = "\n".join(ab_tables.flag_lines(procs))
    assert "- c = 1, vllm-serve r2: ITL p50 5.000 ms (the others 4.000-4.010): moe-serve " in text
    cell = headline.cell(procs, 1, "itl_speedup", OURS)          # n/a (a wide interval), the stall named
    assert cell.text.startswith("n/a: too few processes for its interval (3 + 3: [")
    assert cell.text.endswith(f"; without vllm-serve r2 (outside its variant's spread): {ab_tables.ratio_text(without)} "
                              "(3 + 2)")


@pytest.mark.parametrize(("rounds", "gaps", "levels", "requests", "want"), [
    (2, (4000, 3000), (1,), 4, "n/a: too few processes (2 + 2; needs 3 + 3)"),
    (3, (4000, 3000), (1,), 4, "**1.333 ["),
    (3, (4000, 3000), (8,), 32, "n/a: too few requests (32 a process; needs 256 at c >= 8)"),
])
def test_a_headline_cell_meets_the_bar_or_says_why_not(tmp_path: Path, rounds: int, gaps: tuple[int, int],
                                                        levels: tuple[int, ...], requests: int, want: str) -> None:
    for r in range(rounds):
        _process(tmp_path, BASELINE, r, gaps[0] + r, levels, requests)
        _process(tmp_path, OURS, r, gaps[1] + r, levels, requests)
    key = "itl_speedup" if levels == (1,) else "tok_s_ratio"
    cell = headline.cell(serve_stats.load([tmp_path]), levels[0], key, OURS)
    assert cell.text.startswith(want) and cell.met == want.startswith("**")


def test_a_wide_interval_needs_four_processes_a_side(tmp_path: Path) -> None:
    for r, (b, o) in enumerate(((4000, 3000), (4400, 2700), (3600, 3300))):
        _process(tmp_path, BASELINE, r, b)
        _process(tmp_path, OURS, r, o)
    cell = headline.cell(serve_stats.load([tmp_path]), 1, "itl_speedup", OURS)
    assert cell.text.startswith("n/a: too few processes for its interval (3 + 3: [") and "needs 4 + 4" in cell.text


def test_the_headline_names_the_baselines_table_and_tables_refuse_a_dirty_run(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "serve-x" / "run"
    for r in range(3):
        _process(run, BASELINE, r, 4000 + r, log=DEFAULT_LINE.format(f"/site/configs/{BF16_H100}"))
        _process(run, OURS, r, 3000 + r)
    row = headline.row_data(headline.HeadlineRow("qwen3-30b-a3b", (run,)))
    assert row.baseline == f"default (untuned: no `{BF16_H100}`) (the server log agrees in 3 of 3)"
    assert row.c1.met and row.commits == ("ccccccc",)
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    assert tables.runs("serve-x") == (run,)
    meta = json.loads((run / OURS / "r1" / "meta.json").read_text())
    (run / OURS / "r1" / "meta.json").write_text(json.dumps({**meta, "dirty": True}))
    with pytest.raises(SystemExit, match="1 processes ran from a tree with uncommitted changes"):
        tables.runs("serve-x")


@pytest.mark.parametrize(("spread_us", "rounds"), [(5, 3), (600, 4)])
def test_the_yardstick_adds_a_round_while_the_c1_interval_is_wide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   spread_us: int, rounds: int) -> None:
    """3 rounds, then a 4th only where the c = 1 interval is wider than 2 % (processes stand in: files
    as a server process leaves them, no server started)."""
    from moe_serve.bench.serve import yardstick

    def fake_process(a, variant, rnd, model, flags, meta0, profile, log) -> float:   # noqa: ANN001
        gap = (4000 if variant == BASELINE else 3000) + spread_us * (rnd % 2)
        d = _process(a.out, variant, rnd, gap, requests=32)
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, **meta0, "profiled": False, "end": 1.0, "wall_s": 1.0}))
        return 1.0

    monkeypatch.setattr(yardstick, "host_meta", lambda a, host, work, cfg, model_dir: {
        "workload": work, "requests_per_level": {"1": 32}, "host": "h"})
    monkeypatch.setattr(yardstick, "run_process", fake_process)
    code = yardstick.main(["--model", "embedded", "--out", str(tmp_path), "--concurrency", "1",
                           "--variants", "vllm-serve,moe-serve"])
    assert code == 0 and sorted(p.name for p in (tmp_path / BASELINE).iterdir()) == [f"r{r}" for r in range(rounds)]
    assert ("adding round 3: c = 1 moe-serve: 3 + 3" in capsys.readouterr().out) == (rounds == 4)
