"""JIT monitor with real sm_90 compiles on CPU (moe_serve.kernels.moe.aot fake driver, no GPU, no interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.kernels.plugin import jit_monitor


def _probe(mode: str, cache_dir: Path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_monitor_probe.py")),
                          mode], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_no_recompile_with_do_not_specialize(tmp_path):
    r = _probe("dns", tmp_path)
    assert r["snapshot"] == {"_copy_kernel|warmup|compile": 1}
    kernel, phase, kind, info_keys, signature = r["events"][0]
    assert (kernel, phase, kind) == ("_copy_kernel", "warmup", "compile")
    assert {"key", "signature", "constants", "seconds"} <= set(info_keys)
    assert "n" in signature


def test_recompiles_without_do_not_specialize(tmp_path):
    r = _probe("nodns", tmp_path)
    # n == 1 and n % 16 == 0 are specialized: two more variants in serving
    assert r["snapshot"] == {"_copy_kernel|warmup|compile": 1, "_copy_kernel|serving|compile": 2}


def test_disk_cache_load_is_not_a_compile(tmp_path):
    r = _probe("cache", tmp_path)
    assert r["snapshot"] == {"_copy_kernel|warmup|compile": 1,
                             "_copy_kernel|warmup|cache_load": 1}


def test_in_process_api():
    """install/uninstall chain an existing hook; listeners and phases work without compiles."""
    from triton import knobs

    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    try:
        jit_monitor.install()
        jit_monitor.reset()
        jit_monitor.set_phase("serving")
        jit_monitor._pre_hook(key="k")
        jit_monitor._post_hook(key="k", fn=type("F", (), {"name": "kern"})(), compile={})
        assert seen == ["k"]
        assert jit_monitor.compiles("serving") + jit_monitor.compiles(
            "serving", "cache_load") == 1
        jit_monitor.uninstall()
        assert knobs.runtime.jit_post_compile_hook is not None
    finally:
        knobs.runtime.jit_post_compile_hook = None
        jit_monitor.set_phase("warmup")


@pytest.mark.parametrize("dtype,n_kernels", [("bf16", 4), ("fp8", 5), ("fp8-block", 4)])
def test_fused_moe_compiles_once_over_m(dtype, n_kernels, tmp_path):
    """Our real MoE kernels compiled for sm_90 in a subprocess (no interpreter), fixed config,
    M sweep after warm-up: one compile per kernel (align, gemm1, gemm2, top-k sum; fp8 with
    float hidden states adds the quantize-once kernel, one variant for x and act; block FP8
    with fp8 hidden states has none: GEMM1's epilogue quantizes act), then none."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    ms = ["3", "1", "2", "16", "17", "31", "32", "64", "100", "257"]
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_aot_sweep.py")), dtype,
                          *ms], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    snap = json.loads(res.stdout.strip().splitlines()[-1])
    warm = {k: v for k, v in snap.items() if k.endswith("|warmup|compile")}
    assert sum(warm.values()) == n_kernels, snap
    assert not any("|serving|" in k for k in snap), snap
