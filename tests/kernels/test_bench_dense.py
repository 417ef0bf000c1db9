"""`moe-serve bench kernels --dense` (bench/experts/dense.py, dense_shapes.py): the dense shapes a
decode step runs per rank, the config search, and the whole part on CPU under the interpreter
(every config checked into poisoned outputs, rows, the search, tables kernels.dense.configs reads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.experts.dense import coordinate_search, feasible, with_value
from bench.experts.dense_shapes import NAMED, dense_shapes
from kernels.dense import configs

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "bench" / "models"


def _shapes(model: str, tp: int) -> dict[str, tuple[int, int, int]]:
    cfg = json.loads((MODELS / model / "config.json").read_text())
    return {s.name: (s.N, s.K, s.per_step) for s in dense_shapes(cfg, tp)}


def test_dense_shapes_per_rank() -> None:
    assert _shapes("qwen3-30b-a3b", 1) == {"qkv": (5120, 2048, 48), "o": (2048, 4096, 48),
                                           "lm_head": (32000, 2048, 1)}
    # 4 KV heads over 8 ranks: one replicated per rank
    assert _shapes("qwen3-30b-a3b", 8) == {"qkv": (768, 2048, 48), "o": (2048, 512, 48), "lm_head": (4000, 2048, 1)}
    assert {s.name: (s.N, s.K) for s in NAMED["mixtral-8x7b/tp1"]} == {
        "qkv": (6144, 4096), "o": (4096, 4096), "lm_head": (32000, 4096)}
    assert NAMED["qwen3-30b-a3b/tp1"][-1].N == 151936
    # DeepSeek-V3: MLA attention not listed; 3 dense MLP layers, one shared expert in the 58 MoE layers
    assert _shapes("deepseek-v3", 8) == {"mlp_gate_up": (4608, 7168, 3), "mlp_down": (7168, 2304, 3),
                                         "shared_gate_up": (512, 7168, 58), "shared_down": (7168, 256, 58),
                                         "lm_head": (16160, 7168, 1)}


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


def test_the_dense_part_on_cpu_checks_times_searches_and_writes_tables(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "service", "bench", "kernels", "--dense", "--smoke", "--out",
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["dense"]
    assert [(r["shape"], r["M"]) for r in rows] == [("qkv", 1), ("qkv", 4), ("o", 1), ("o", 4)]
    assert all(r["ours_us"] > 0 and r["best_us"] <= r["ours_us"] and "error" not in r for r in rows), rows
    tried = results["dense-sweep"]
    assert len(tried) > len(rows) and all("us" in t for t in tried), [t for t in tried if "error" in t]
    assert "| tiny/tp1 | qkv | 48 x 256 | 1 |" in res.stdout
    tables = tmp_path / "dense-tables"
    assert sorted(p.name for p in tables.iterdir()) == [configs.table_file_name(40, 512, "bf16", "cpu"),
                                                        configs.table_file_name(48, 256, "bf16", "cpu")]
    code = ("import sys, json; from kernels.dense import configs; "
            "t = configs.load_table(48, 256, 'bf16', 'cpu'); print(json.dumps({str(k): v for k, v in t.items()}))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**env, "MOE_SERVE_KERNEL_CONFIG_DIR": str(tables)})
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    best = {str(r["M"]): r["best"] for r in rows if r["shape"] == "qkv"}
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == best


def test_tables_keep_only_the_buckets_where_the_gemv_beat_f_linear(tmp_path: Path) -> None:
    from bench.experts.dense import write_tables

    cfg = {"BLOCK_N": 1, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "ACC_PAIRS": True, "PREFETCH": True}
    row = lambda N, M, best_us, cublas_us: dict(N=N, K=2048, M=M, best=cfg, best_us=best_us,  # noqa: E731
                                                cublas_us=cublas_us)
    rows = [row(5120, 1, 9.4, 10.6), row(5120, 2, 10.5, 10.6), row(5120, 4, 12.6, 10.7),   # a win, a tie, a loss
            row(2048, 1, 11.0, 11.0)]                                                       # no win at all
    paths = write_tables(rows, tmp_path, "NVIDIA_H100_80GB_HBM3")
    assert [p.name for p in paths] == [configs.table_file_name(5120, 2048, "bf16", "NVIDIA_H100_80GB_HBM3")]
    assert sorted(k for k in json.loads(paths[0].read_text()) if k.isdigit()) == ["1"]
