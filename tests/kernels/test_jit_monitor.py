"""JIT monitor with real sm_90 compiles on CPU (kernels.aot fake driver, no GPU, no interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl

from kernels import aot, jit_monitor


def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def monitor(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    jit_monitor.install()
    jit_monitor.reset()
    jit_monitor.set_phase("warmup")
    yield jit_monitor
    jit_monitor.uninstall()
    jit_monitor.set_phase("warmup")


def _sweep(jf, ms) -> None:
    x = torch.zeros(64)
    with aot.fake_cuda():
        for m in ms:
            jf.warmup(x, x, m, BLOCK=64, grid=(1,))


def _count(kernel: str, phase: str, kind: str = "compile") -> int:
    return jit_monitor.snapshot().get((kernel, phase, kind), 0)


def test_no_recompile_with_do_not_specialize(monitor):
    events = []
    monitor.add_listener(lambda *a: events.append(a))
    jf = aot.jit_function(_copy_kernel, do_not_specialize=["n"])
    _sweep(jf, [7])                                   # warm-up
    monitor.set_phase("serving")
    _sweep(jf, [1, 2, 16, 17, 32, 33, 48, 63, 64])
    assert _count("_copy_kernel", "warmup") == 1
    assert _count("_copy_kernel", "serving") == 0
    assert events and events[0][:3] == ("_copy_kernel", "warmup", "compile")
    assert "signature" in events[0][3]
    monitor.remove_listener(events.append)


def test_recompiles_without_do_not_specialize(monitor):
    jf = aot.jit_function(_copy_kernel)
    _sweep(jf, [7])
    monitor.set_phase("serving")
    _sweep(jf, [1, 2, 16, 17, 32, 33])                # n == 1 and n % 16 == 0 specialize
    assert _count("_copy_kernel", "serving") == 2


def test_disk_cache_load_is_not_a_compile(monitor):
    _sweep(aot.jit_function(_copy_kernel, do_not_specialize=["n"]), [3])
    _sweep(aot.jit_function(_copy_kernel, do_not_specialize=["n"]), [3])  # fresh in-memory cache
    assert _count("_copy_kernel", "warmup", "compile") == 1
    assert _count("_copy_kernel", "warmup", "cache_load") == 1


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fused_moe_compiles_once_over_m(dtype, tmp_path):
    """Our real MoE kernels compiled for sm_90 in a subprocess (no interpreter), fixed config,
    M sweep after warm-up: 4 compiles (align, gemm1, gemm2, top-k sum), then none."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    ms = ["3", "1", "2", "16", "17", "31", "32", "64", "100", "257"]
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_aot_sweep.py")), dtype,
                          *ms], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    snap = json.loads(res.stdout.strip().splitlines()[-1])
    warm = {k: v for k, v in snap.items() if k.endswith("|warmup|compile")}
    assert sum(warm.values()) == 4, snap
    assert not any("|serving|" in k for k in snap), snap
