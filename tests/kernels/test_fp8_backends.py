"""bench/fp8_backends.py on CPU (interpreter): ours is checked against the float64 reference
and timed; backends that cannot run here are absent from the rows, never numbers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fp8_backends  # noqa: E402


def test_smoke_rows_check_ours_and_leave_absent_backends_out(tmp_path):
    assert fp8_backends.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fp8_backends.json").read_text())
    rows = res["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [("tiny-a", 1), ("tiny-a", 4), ("tiny-b", 1), ("tiny-b", 4)]
    for r in rows:
        assert 0 < r["ours_err"] < 0.02, r          # fp8 W8A8 vs the float64 reference
        assert r["ours_us"] > 0 and r["route"] in ("ours", "vllm")
        assert not any(k.startswith(("vllm_triton", "flashinfer")) for k in r), r
    assert res["meta"]["device"] == "cpu"


def test_shapes_selects_and_unknown_names_are_an_error(tmp_path, capsys):
    assert fp8_backends.main(["--smoke", "--shapes", "tiny-b", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp8_backends.json").read_text())["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [("tiny-b", 1), ("tiny-b", 4)]
    with pytest.raises(SystemExit) as e:
        fp8_backends.main(["--shapes", "Mixtral-8x7B/TP3", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "Mixtral-8x7B/TP3" in capsys.readouterr().err


def test_flush_l2_is_refused_without_a_gpu(tmp_path, capsys):
    from kernels.tuning.timing import time_graph

    with pytest.raises(SystemExit) as e:
        fp8_backends.main(["--smoke", "--flush-l2", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--flush-l2 needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(ValueError, match="flush_l2 needs a CUDA device"):
        time_graph(lambda i: None, 2, flush_l2=True)
