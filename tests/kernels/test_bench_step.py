"""`moe-serve bench step` on a CPU: the dry run end to end (kernel level through the ops' torch
fallbacks), and the model level's summary of a committed, profiled yardstick run."""
from __future__ import annotations

import json
from pathlib import Path

from moe_serve.bench.step import cli, model_level

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
PROFILED = RESULTS / "serve-qwen3-30b-a3b-bf16-h200-2026-12-04" / "2026-12-03-155b92d"


def test_dry_run_checks_and_times_every_piece(tmp_path: Path, capsys) -> None:
    pieces_asked = "norm_gemv/qkv,norm_gemv/gate,qk_norm_rope_cache,decode_attention"
    code = cli.main(["--dry-run", "--out", str(tmp_path), "--tokens", "1", "--pieces", pieces_asked])
    assert code == 0
    record = json.loads((tmp_path / "kernels.json").read_text())
    rows, run = record["rows"], record["run"]
    assert run["argv"][:2] == ["--dry-run", "--out"] and run["gpu"] == "cpu"
    assert len(run["source_sha256"]) == 64 and run["torch"] and run["triton"]
    assert run["commit"] is None or len(run["commit"]) == 40
    pieces = {(r["piece"], r["M"]) for r in rows}
    assert pieces == {(p, 1) for p in pieces_asked.split(",")}
    for r in rows:
        assert r["ok"], r
        assert r["errors"]["fused"] < 1e-5          # our kernel (interpreted, fp32) against the chain or float64
        assert r["fused_us"] > 0 and r["chain_us"] > 0
        assert r["saved_us_per_step"] == r["per_step"] * (r["chain_us"] - r["fused_us"])
    printed = capsys.readouterr().out
    assert "| norm_gemv/qkv | fuse_norm_gemv |" in printed and "Predicted saving" in printed
    assert (tmp_path / "step.md").read_text().strip() == printed.split("[step]")[-1].split("\n", 1)[1].strip()


def test_model_level_summary_of_a_profiled_run() -> None:
    rows = {r["variant"]: r for r in model_level.summary(PROFILED)}
    assert set(rows) == {"moe-serve", "vllm-serve"}
    ours, base = rows["moe-serve"], rows["vllm-serve"]
    assert ours["vs_moe_serve"] == 1.0
    assert abs(base["vs_moe_serve"] - ours["itl_p50_ms"] / base["itl_p50_ms"]) < 1e-12
    assert 100 < ours["launches_per_step"] < base["launches_per_step"]   # our router and decode path launch less
    new, gone = base["kernels_changed"]
    assert new > 0 and gone > 0 and ours["kernels_changed"] is None      # vLLM's MoE kernels against ours
    text = model_level.table(list(rows.values()))
    assert "| moe-serve | 1 |" in text and f"| {new} / {gone} |" in text


def test_model_level_flags_a_switch_set_that_ran_the_same_kernels() -> None:
    """A switch that took no layer shows as "none" (a set that ran moe-serve's kernels exactly)."""
    rows = [{"variant": "moe-serve+x", "processes": 1, "itl_p50_ms": 4.0, "vs_moe_serve": 1.0,
             "launches_per_step": 650.0, "kernels_changed": (0, 0)}]
    assert "| none: the same kernels |" in model_level.table(rows)


def test_model_level_asks_the_yardstick_for_one_profiled_process_per_set(tmp_path: Path) -> None:
    argv = model_level.yardstick_argv("qwen3-30b-a3b", tmp_path, ("vllm-serve", "moe-serve+fuse_norm_gemv"), 480, [])
    assert argv[argv.index("--variants") + 1] == "vllm-serve,moe-serve+fuse_norm_gemv"
    assert argv[argv.index("--concurrency") + 1] == "1" and argv[argv.index("--processes") + 1] == "1"
    assert "--profile" in argv and argv[argv.index("--profile-levels") + 1] == "1"


def test_sweep_dry_run_checks_every_config_and_tables_only_winning_buckets(tmp_path: Path) -> None:
    """--sweep on CPU: the fused norm + GEMV's search at one token block, every config checked
    before it is timed; the interpreted kernel loses to torch's chain, so no table is written."""
    code = cli.main(["--dry-run", "--out", str(tmp_path), "--tokens", "1", "--pieces", "norm_gemv/qkv", "--sweep"])
    assert code == 0
    (row,) = json.loads((tmp_path / "sweep.json").read_text())
    assert (row["piece"], row["M"], row["N"]) == ("norm_gemv/qkv", 1, 128)
    assert row["configs_timed"] >= 2 and row["configs_failed"] == 0
    assert all(r["err"] < 1e-5 and r["us"] > 0 for r in row["timed"])
    assert row["best_us"] == min(r["us"] for r in row["timed"])
    assert not (tmp_path / "norm-gemv-tables").exists() or not any((tmp_path / "norm-gemv-tables").iterdir())
    assert "The fused norm + GEMV's configs" in (tmp_path / "step.md").read_text()


def test_sweep_tables_keep_the_buckets_that_beat_the_chain(tmp_path: Path) -> None:
    from moe_serve.bench.step import sweep
    from moe_serve.kernels.dense import configs

    cfg = configs.default_config(1, 64, 256, "bf16")
    rows = [{"N": 64, "K": 256, "dtype": "bf16", "M": M, "chain_us": 10.0, "best_us": best, "best": cfg}
            for M, best in ((1, 9.0), (2, 9.8), (4, None), (8, 5.0))]      # 2: within WIN_MARGIN
    assert sweep.tables(rows) == {(64, 256, "bf16"): {1: cfg, 8: cfg}}
    (path,) = sweep.write_tables(rows, tmp_path, "GPU_X")
    assert path.name == configs.table_file_name(64, 256, "bf16", "GPU_X", configs.NORM_GEMV)
    assert {k: v for k, v in json.loads(path.read_text()).items() if k.isdigit()} == {"1": cfg, "8": cfg}
