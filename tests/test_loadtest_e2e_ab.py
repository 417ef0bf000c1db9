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
    """Two server starts (~150 s each for Mixtral dummy weights) + the default load < 9.5 min."""
    drv = load_driver()
    a = drv.parse_args(["--out", "/tmp/x"])
    load = sum(drv.build(s, drv.Options(max_users=a.max_users, step_seconds=a.step_seconds)).duration
               for s in a.scenarios.split(","))
    assert 2 * (150 + load + 15) < 9.5 * 60
