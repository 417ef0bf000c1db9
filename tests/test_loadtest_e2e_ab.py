"""bench/e2e_ab.py pieces that run on CPU: model dirs (config + tokenizer) and the time plan."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loadtest.server_proc import REPO


def load_driver():
    spec = importlib.util.spec_from_file_location("e2e_ab", REPO / "bench" / "e2e_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_model_configs_use_the_mixtral_tokenizer_vocab(name: str) -> None:
    cfg = json.loads((REPO / "bench" / "models" / name / "config.json").read_text())
    assert cfg["vocab_size"] == 32000 and cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2


def test_prepare_model_writes_tokenizer_and_dummy_load(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    drv = load_driver()
    model_dir, args = drv.prepare_model("mixtral-8x7b", tmp_path)
    assert args == ["--engine-arg", 'load_format="dummy"']
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 32000 and tok.encode("hello world")
    assert json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "mixtral"


def test_default_load_fits_one_device_call() -> None:
    """Two server starts (109-142 s measured on the H200 for the per-rank Mixtral) + the default load < 9.5 min."""
    drv = load_driver()
    a = drv.parse_args(["--out", "/tmp/x"])
    load = sum(drv.build(s, drv.Options(max_users=a.max_users, step_seconds=a.step_seconds)).duration
               for s in a.scenarios.split(","))
    assert 2 * (150 + load + 15) < 9.5 * 60


def _fake_run(root: Path, tok_s: dict[str, float], ttft_s: dict[str, list[float]]) -> Path:
    """A run dir as e2e_ab.py writes it: one stage per scenario, requests with the given TTFTs."""
    for v in ("optimized", "vllm"):
        for sc in ("spike-sizes", "step"):
            d = root / v / sc
            d.mkdir(parents=True)
            stage = {"users": 4, "output_tok_s": tok_s[v], "itl_p50_ms": 10.0 / tok_s[v], "ttft_p50_ms": 20.0}
            comp = {"total": 0 if v == "optimized" else 3, "per_kernel": {}}
            (d / "report.json").write_text(json.dumps({"stages": [stage], "serving_jit_compiles": comp}))
            recs = [{"status": "ok", "ttft": t} for t in ttft_s[v]] + [{"status": "error", "ttft": None}]
            (d / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    return root


def test_pool_ratios_and_geomean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("e2e_pool", REPO / "bench" / "e2e_pool.py")
    pool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool)
    ttft = {"optimized": [0.01 * i for i in range(1, 101)], "vllm": [0.02 * i for i in range(1, 101)]}
    r1 = _fake_run(tmp_path / "r1", {"optimized": 110.0, "vllm": 100.0}, ttft)
    r2 = _fake_run(tmp_path / "r2", {"optimized": 90.0, "vllm": 100.0}, ttft)
    assert pool.main([str(r1), str(r2)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["1.100", "0.900"]                  # tok/s ratio per run
    assert cells[7] == f"**{(1.1 * 0.9) ** 0.5:.3f}**"       # geomean 0.995
    assert cells[3:5] == [f"{1 / 1.1:.3f}", f"{1 / 0.9:.3f}"]  # ITL ratio is the inverse here
    assert "| 1 | optimized | 100 | 510.0 | 1000.0 | 1000.0 | 0 |" in out  # the error request is left out
    assert "| 2 | vllm | 100 | 1020.0 | 2000.0 | 2000.0 | 3 |" in out
