"""`moe-serve bench kernels` on CPU: the whole command under the Triton interpreter on tiny shapes
(every variant checked against float64, the bench rows and their table, the compile count), and
`moe-serve bench` / `bench serve` / `bench kernels` --help without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    return subprocess.run([sys.executable, "-m", "moe_serve.service", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_bench_kernels_smoke_checks_every_variant_and_tables_the_bench(tmp_path: Path) -> None:
    res = _bench("kernels", "--smoke", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    corr = results["correctness"]
    assert corr and all(r["ok"] for r in corr), [r for r in corr if not r["ok"]]
    assert {r["variant"] for r in corr} >= {"fp16", "fp8-tensor-dyn", "fp8-chan-static"}
    bench = results["bench"]
    assert {(r["shape"], r["dtype"]) for r in bench} == {(s, d) for s in ("tiny-a", "tiny-b") for d in ("bf16", "fp8")}
    assert all(r["ours_us"] > 0 and "error" not in r for r in bench)
    assert results["compiles"]["ours_serving_compiles"] == 0          # warm-up covered every M
    assert all(r["ok"] for r in results["block-correctness"])
    assert "| tiny-a | bf16 | no | 1..4 (2) |" in res.stdout            # the per-shape table, printed last


def test_bench_kernels_refuses_to_run_without_a_gpu_or_the_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    res = _bench("kernels", "--out", str(tmp_path), interpret=False)
    assert res.returncode == 2 and "no CUDA GPU visible" in res.stdout


@pytest.mark.parametrize("cmd", [(), ("serve",), ("kernels",), ("tables",)])
def test_bench_help_says_what_each_measures_and_how_long(cmd: tuple[str, ...]) -> None:
    res = _bench(*cmd, "--help", interpret=False)
    assert res.returncode == 0, res.stderr[-2000:]
    text = res.stdout
    if not cmd:
        assert all(name in text for name in ("serve", "kernels", "tables")) and "H200" in text
    elif cmd != ("tables",):
        assert "Time on one H200" in text and "--out" in text
    else:
        assert "--check" in text


def test_an_unknown_bench_command_names_the_known_ones() -> None:
    res = _bench("nope", interpret=False)
    assert res.returncode == 2 and "unknown command 'nope'" in res.stderr and "kernels" in res.stderr
