"""bench/bench_dense.py on CPU: its sweep grid and its refusals (the timing needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from bench import bench_dense
from kernels.dense.decode_linear import LinearPlan, plan


def test_the_sweep_surrounds_the_default_plan() -> None:
    base = plan(1, 2048, 4096)
    grid = bench_dense.sweep_plans(base)
    assert base in grid and len(grid) == len(set(grid)) == 3 * 2 * 3 * 2
    assert {p.SPLIT_K for p in grid} == {base.SPLIT_K // 2, base.SPLIT_K, base.SPLIT_K * 2}
    assert {p.SPLIT_K for p in bench_dense.sweep_plans(LinearPlan(64, 256, 1))} == {1, 2}


def test_every_named_shape_is_a_weight_and_the_cli_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert all(N >= 1 and K % 128 == 0 for N, K in bench_dense.SHAPES.values())
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench_dense.main(["--sweep", "--m", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert bench_dense.main(["--shapes", "nope"]) == 2
