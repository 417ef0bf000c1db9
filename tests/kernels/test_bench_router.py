"""`moe-serve bench kernels --router` (bench/experts/router.py): the router of a model's config, the
checks that decide a cell (they fail on wrong experts or weights), and the whole part on CPU
under the interpreter (both top-k methods checked and timed, the table printed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.bench.experts.router import RouterShape, _choice_keys, check_reference, router_shape
from moe_serve.kernels.moe.router_topk import TOPK_METHODS, router_topk

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "bench" / "models"


def _config(model: str) -> dict:
    return json.loads((MODELS / model / "config.json").read_text())


def test_router_shape_from_config() -> None:
    assert router_shape(_config("qwen3-30b-a3b")) == RouterShape(128, 2048, 8)
    assert router_shape(_config("mixtral-8x7b")) == RouterShape(8, 4096, 2)
    with pytest.raises(ValueError, match="grouped"):           # DeepSeek-V3: 8 groups, top-4 groups
        router_shape(_config("deepseek-v3"))
    flat = {**_config("deepseek-v3"), "n_group": 1, "topk_group": 1}
    assert router_shape(flat) == RouterShape(256, 7168, 8, "sigmoid", True, True, 2.5)
    with pytest.raises(ValueError, match="not a MoE"):
        router_shape({"hidden_size": 64})


def test_the_reference_check_fails_on_wrong_experts_or_weights() -> None:
    shape = RouterShape(16, 64, 4)
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    x, gate = torch.randn(2, 64, generator=g), torch.randn(16, 64, generator=g) / 8
    score, key, scale = _choice_keys(x, gate, shape, None)
    w, ids = router_topk(x, gate, 4)
    assert check_reference(shape, (w, ids), score, key, scale) == 0
    worst = key.argmin(-1, keepdim=True).to(torch.int32)               # a clearly unchosen expert
    with pytest.raises(AssertionError, match="near-tie"):
        check_reference(shape, (w, torch.cat([ids[:, :3], worst], 1)), score, key, scale)
    with pytest.raises(AssertionError, match="weights"):
        check_reference(shape, (w * 1.01, ids), score, key, scale)
    with pytest.raises(AssertionError, match="repeated"):
        check_reference(shape, (w, ids[:, [0, 0, 1, 2]]), score, key, scale)


def test_the_router_part_on_cpu_checks_and_times_every_method(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "moe_serve.service", "bench", "kernels", "--router", "--smoke", "--sets", "2",
                          "--replays", "5", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["router"]
    assert [(r["shape"], r["M"]) for r in rows] == [("tiny", 1), ("tiny", 3), ("tiny-sigmoid", 1), ("tiny-sigmoid", 3)]
    assert all(r[f"{m}_us"] > 0 and r[f"{m}_near_ties"] == 0 for r in rows for m in TOPK_METHODS), rows
    assert all(0 <= r["methods_max_weight_diff"] < 1e-4 for r in rows), rows   # recorded, within the float64 check's
    assert "| tiny-sigmoid | 12 x 48, 3 | 3 |" in res.stdout
