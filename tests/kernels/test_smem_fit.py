"""Every config the loader returns fits Hopper's shared memory (227 KB per CTA): statically
for all bench shapes, dtypes and M up to 16384 (moe_serve.kernels.moe.smem.estimate), and for the configs
closest to the limit plus a random sample by real sm_90 compiles (moe_serve.kernels.moe.aot, subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moe_serve.kernels.moe import configs, smem

HELPER = Path(__file__).with_name("_smem_sweep.py")


def test_fit_reduces_stages_then_block_k():
    cfg = configs.validate(dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4,
                                num_stages=4, SWAP_AB=True))
    assert max(smem.gemm_estimates(cfg, "bf16")) > smem.SMEM_LIMIT   # the H200's 278528 B case
    fit = smem.fit(cfg, "bf16")
    assert fit["num_stages"] == 3 and fit["BLOCK_K"] == 128
    assert max(smem.gemm_estimates(fit, "bf16")) <= smem.SMEM_LIMIT
    big = configs.validate(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=256, GROUP_M=1, num_warps=8,
                                num_stages=5, SWAP_AB=False))
    f2 = smem.fit(big, "fp8")
    assert f2["num_stages"] == 2 and f2["BLOCK_K"] < 256
    assert max(smem.gemm_estimates(f2, "fp8")) <= smem.SMEM_LIMIT
    small = smem.fit(configs.default_config(1, 8, 1792, 4096, 2, "bf16"), "bf16")
    assert small == smem.fit(small, "bf16")                            # idempotent


def test_h200_failures_are_covered():
    """The two configs that failed on the H200 (Triton 3.6: 278528 B and 290816 B needed)."""
    assert smem.estimate(16, 128, 128, 4, 2, 2, True) >= 278528
    assert smem.estimate(16, 128, 256, 4, 2, 1, True) >= 290816


def test_all_configs_fit_and_compile_under_limit():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, str(HELPER), "6", "4"], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["over_estimate"] == []
    assert res["max_estimate"] <= smem.SMEM_LIMIT
    assert len(res["compiled"]) >= 20
    for row in res["compiled"]:
        assert row["shared"] <= row["est"], row          # the estimate is an upper bound
        assert row["shared"] <= smem.SMEM_LIMIT, row
