"""kernels.dense.decode_linear (a dense linear layer at decode on our down kernel) against the
float64 reference under TRITON_INTERPRET=1: fresh random inputs, NaN-poisoned outputs, every
split and tile shape class (N and K not multiples of the tiles, one and several K splits)."""
from __future__ import annotations

import pytest
import torch

from kernels.dense.decode_linear import MAX_M, TARGET_TILES, LinearPlan, decode_linear, eligible, plan
from reference import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

CASES = [  # M, N, K, plan
    (1, 64, 128, LinearPlan(64, 64, 1)),
    (1, 40, 200, LinearPlan(16, 32, 4)),          # N % BLOCK_N, K % BLOCK_K != 0; 4 splits
    (2, 96, 256, LinearPlan(32, 64, 2, SWAP_AB=False)),
    (3, 8, 96, LinearPlan(64, 32, 2)),            # a gate: fewer rows than one tile
    (4, 72, 160, LinearPlan(32, 32, 8)),          # more splits than full chunks: empty splits
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_float64(case: int, dtype: torch.dtype) -> None:
    M, N, K, cfg = CASES[case]
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    assert decode_linear(x, w, out=out, cfg=cfg) is out
    assert rel_err(out, x.double() @ w.double().T) < TOL[dtype]
    again = decode_linear(x, w, cfg=cfg)          # the split workspace is zero again after a call
    assert rel_err(again, x.double() @ w.double().T) < TOL[dtype]


def test_strided_rows_and_the_default_plan() -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    base = torch.randn(2, 3 * 160, generator=g, dtype=torch.float16)
    x = base[:, 160:320]                          # a column slice: row stride 480
    w = (torch.randn(48, 160, generator=g) / 160 ** 0.5).half()
    assert rel_err(decode_linear(x, w), x.double() @ w.double().T) < TOL[torch.float16]


def test_plan_fills_the_gpu_with_powers_of_two() -> None:
    assert plan(1, 2048, 4096) == LinearPlan(64, 256, 8)     # 32 tiles x 8 splits
    assert plan(1, 5120, 2048) == LinearPlan(64, 256, 2)     # 80 tiles: 3 -> 2
    assert plan(1, 8, 4096) == LinearPlan(64, 256, 16)       # a gate: all 16 K chunks
    assert plan(1, 151936, 2048).SPLIT_K == 1
    for N, K in ((2048, 4096), (6144, 4096), (1024, 512), (8, 128)):
        p = plan(1, N, K)
        tiles = -(-N // p.BLOCK_N) * p.SPLIT_K
        assert p.SPLIT_K & (p.SPLIT_K - 1) == 0 and p.SPLIT_K <= -(-K // p.BLOCK_K)
        assert tiles <= max(TARGET_TILES, -(-N // p.BLOCK_N))


def test_refuses_what_it_does_not_compute() -> None:
    x, w = torch.zeros(1, 64, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="M=5"):
        decode_linear(torch.zeros(MAX_M + 1, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="contiguous"):
        decode_linear(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="need"):
        decode_linear(x.float(), w)
    with pytest.raises(ValueError, match="out must be"):
        decode_linear(x, w, out=torch.empty(1, 31, dtype=torch.float16))
    assert eligible(x, w) and not eligible(x, w[:, :32]) and not eligible(x.to(torch.int8), w.to(torch.int8))
