"""The CUDA-core decode path (moe_serve.kernels.moe.moe_gemv, a GEMV config) against the float64 reference,
under TRITON_INTERPRET=1: every weight format and split, into NaN-poisoned outputs, on fresh
random inputs. FP8 weights are dequantized and the activations kept in their float dtype (W8A16),
so the reference is the dequantized weights' exact product, with no activation rounding."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe import configs, heuristics
from moe_serve.kernels.moe.config_schema import label, validate
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe, num_programs
from moe_serve.bench.experts.reference import (FP8, moe_reference, quant_act_groups, quant_fp8, quant_fp8_block, rel_err,
                       routing)

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _cfg(M: int, topk: int, bn: int, bk: int, down_bn: int, down_bk: int, split: int = 1,
         down_split: int = 1, warps: int = 4) -> dict:
    return {"DECODE": True, "GEMV": True, "PDL": True, "BLOCK_M": heuristics.decode_block_m(M, topk),
            "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": warps, "num_stages": 1,
            "SWAP_AB": False, "SPLIT_K": split,
            "DOWN": {"BLOCK_N": down_bn, "BLOCK_K": down_bk, "GROUP_M": 1, "num_warps": warps,
                     "num_stages": 1, "SWAP_AB": False, "SPLIT_K": down_split}}


def _problem(M: int, E: int, N: int, K: int, topk: int, ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)     # fresh inputs every run
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    tw, ids = routing(M, E, topk, g, ids_dtype=ids_dtype)
    return x, w1, w2, tw, ids


CASES = [  # M, E, N, K, topk, (up BN, BK), (down BN, BK)
    (1, 8, 32, 64, 2, (8, 32), (4, 16)),
    (3, 8, 40, 72, 2, (16, 32), (8, 16)),     # N % BN, K % BK, N % BK != 0
    (2, 16, 24, 48, 4, (1, 16), (2, 64)),     # one weight row per program, BK > N
    (4, 8, 16, 32, 2, (4, 16), (32, 32)),     # every expert hit, tokens share experts
    (1, 4, 32, 32, 1, (2, 32), (16, 16)),     # top-1
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_float(case, dtype):
    M, E, N, K, topk, up, down = CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    out = torch.full((M, K), float("nan"), dtype=dtype)
    fused_moe(x, w1, w2, tw, ids, out=out, config=_cfg(M, topk, *up, *down))
    assert rel_err(out, moe_reference(x, w1, w2, tw, ids)) < TOL[dtype]


def _split_ws_zero() -> bool:
    from moe_serve.kernels.moe import moe_decode_launch as fm
    return all(not (f.any() or c.any()) for f, c in fm._SPLIT_WS.values())


@pytest.mark.parametrize("case,splits", [(0, (2, 1)), (1, (1, 2)), (3, (4, 8)), (1, (8, 16))])
def test_gemv_split_k(case, splits):                                  # (8, 16): more than steps
    """Split-K in either kernel: the workspace is zero again after each call, and a second call
    gives the same sums."""
    M, E, N, K, topk, up, down = CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    ref = moe_reference(x, w1, w2, tw, ids)
    for _ in range(2):
        out = torch.full((M, K), float("nan"))
        fused_moe(x, w1, w2, tw, ids, out=out, config=_cfg(M, topk, *up, *down, *splits))
        assert rel_err(out, ref) < TOL[torch.float32]
        assert _split_ws_zero()


@pytest.mark.parametrize("case,per_channel,x_fp8", [(0, False, False), (1, True, False),
                                                    (2, False, True), (1, True, True)])
def test_gemv_fp8_per_tensor_and_channel(case, per_channel, x_fp8):
    """FP8 weights dequantized in fp32. Float hidden states are not quantized (the static a1/a2
    scales of a checkpoint go unused); fp8 hidden states are dequantized with their static scale."""
    M, E, N, K, topk, up, down = CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8(w1, per_channel)
    q2, s2 = quant_fp8(w2, not per_channel)
    a1 = (x.abs().max() / 448.0).reshape(())
    a2 = torch.tensor(0.5)                        # would distort act if it were applied
    if x_fp8:
        x = (x / a1).to(FP8)
    out = torch.full((M, K), float("nan"), dtype=torch.float32 if not x_fp8 else torch.bfloat16)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, a2), out=out,
              config=_cfg(M, topk, *up, *down, 2, 2))
    ref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1)
    assert rel_err(out, ref) < (1e-5 if not x_fp8 else 1e-2)      # bf16 output rounding
    assert _split_ws_zero()


@pytest.mark.parametrize("x_fp8", [False, True])
def test_gemv_fp8_per_token(x_fp8):
    """FP8-dynamic (per-channel weights, per-token activations): fp8 hidden states carry one
    scale per token."""
    M, E, N, K, topk, up, down = CASES[1]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8(w1, True)
    q2, s2 = quant_fp8(w2, True)
    a1 = None
    if x_fp8:
        a1 = (x.abs().amax(dim=1, keepdim=True) / 448.0).float()        # [M, 1]
        x = (x / a1).to(FP8)
    out = torch.full((M, K), float("nan"), dtype=torch.float32 if not x_fp8 else torch.bfloat16)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, None, per_token_act=True), out=out,
              config=_cfg(M, topk, *up, *down))
    ref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1)
    assert rel_err(out, ref) < (1e-5 if not x_fp8 else 1e-2)


@pytest.mark.parametrize("x_fp8,bks,splits", [(False, (16, 32), (1, 1)), (True, (64, 16), (1, 1)),
                                              (False, (64, 16), (2, 4)), (True, (16, 32), (2, 4))])
def test_gemv_fp8_block(x_fp8, bks, splits):                          # BLOCK_K: 1, 2, 4 groups
    """Block FP8 ([bn, bk] weight blocks, activations per token and bk columns when they come in
    fp8): each BLOCK_K step reduces BLOCK_K / bk groups, each scaled by its block's scale. N, K
    and the row counts are not multiples of the block."""
    M, E, N, K, topk = 3, 8, 40, 72, 2
    bn, bk = 24, 16
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8_block(w1, bn, bk)
    q2, s2 = quant_fp8_block(w2, bn, bk)
    a1 = None
    if x_fp8:
        x, a1 = quant_act_groups(x, bk)
    out = torch.full((M, K), float("nan"), dtype=torch.float32 if not x_fp8 else torch.bfloat16)
    cfg = _cfg(M, topk, 8, bks[0], 16, bks[1], *splits)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, None, block_shape=(bn, bk)), out=out,
              config=cfg)
    ref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1, block_shape=(bn, bk))
    assert rel_err(out, ref) < (1e-5 if not x_fp8 else 1e-2)


def test_gemv_block_k_must_hold_whole_groups():
    M, E, N, K, topk = 1, 4, 32, 64, 2
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8_block(w1, 32, 32)
    q2, s2 = quant_fp8_block(w2, 32, 32)
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, block_shape=(32, 32)),
                  config=_cfg(M, topk, 8, 16, 8, 32))


@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_router_weight_on_input(fp8):
    M, E, N, K = 5, 4, 32, 32
    x, w1, w2, tw, ids = _problem(M, E, N, K, 1, ids_dtype=torch.int64)
    scales, ref_scales = None, (None, None)
    if fp8:
        w1, s1 = quant_fp8(w1, False)
        w2, s2 = quant_fp8(w2, True)
        scales, ref_scales = Fp8Scales(s1, s2), (s1, s2)
    out = torch.full((M, K), float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=scales, apply_router_weight_on_input=True, out=out,
              config=_cfg(M, 1, 8, 16, 8, 16))
    ref = moe_reference(x, w1, w2, tw, ids, *ref_scales, on_input=True)
    assert rel_err(out, ref) < 1e-5


def test_gemv_repeated_experts_and_non_local_ids():
    """Tokens sharing experts (each slot's program reads its expert's rows), and expert id -1
    (not on this rank) contributing nothing."""
    M, E, N, K, topk = 4, 8, 32, 64, 2
    x, w1, w2, tw, _ = _problem(M, E, N, K, topk)
    ids = torch.tensor([[3, 5], [5, 3], [3, -1], [-1, 5]], dtype=torch.int32)
    out = torch.full((M, K), float("nan"))
    fused_moe(x, w1, w2, tw, ids, out=out, config=_cfg(M, topk, 8, 32, 8, 32, 2, 2))
    ref = moe_reference(x, w1, w2, tw * (ids >= 0), ids.clamp(min=0))
    assert rel_err(out, ref) < 1e-5


def test_gemv_config_schema():
    """GEMV configs: BLOCK_N may be below 16, no swap, DECODE only; labels and program counts;
    block FP8 keeps a wider BLOCK_K that is a multiple of the group."""
    cfg = validate(_cfg(1, 8, 8, 512, 4, 256, 1, 4))
    assert cfg["GEMV"] and cfg["DOWN"]["BLOCK_N"] == 4
    assert label(cfg) == "gemv16x8x512/w4|d4x256/w4/sk4/pdl"
    assert num_programs(1, 128, 768, 2048, 8, cfg) == (8 * 96, 512 * 4)
    with pytest.raises(ValueError, match="SWAP_AB"):
        validate({**cfg, "SWAP_AB": True})
    with pytest.raises(ValueError, match="DECODE"):
        validate({k: v for k, v in cfg.items() if k != "DECODE"})
    with pytest.raises(ValueError, match="BLOCK_N"):
        validate({k: v for k, v in cfg.items() if k != "GEMV"})        # tl.dot needs >= 16
    fitted = configs.fit({**cfg, "BLOCK_K": 64}, "fp8_w8a8,block_shape=[128,128]")
    assert (fitted["BLOCK_K"], fitted["DOWN"]["BLOCK_K"]) == (128, 256)


def test_the_gemv_seed_config_serves_block_fp8_at_a_16_token_bucket():
    """heuristics.gemv_config at bucket 16, fitted for block FP8 (what selection runs where the
    fp8_moe_gemv setting sends FP8 layers to this path at M <= 16), on M = 9 with the hidden states
    as vLLM hands them over (fp8, per token per group; float ones: the config families above)."""
    M, E, N, K, topk, block = 9, 4, 40, 64, 2, (32, 32)
    fmt = "fp8_w8a8,block_shape=[32,32]"
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    (q1, s1), (q2, s2) = quant_fp8_block(w1, *block), quant_fp8_block(w2, *block)
    x, a1 = quant_act_groups(x, block[1])
    cfg = configs.fit(heuristics.gemv_config(16, E, N, K, topk, fmt), fmt, topk=topk)
    assert cfg["GEMV"] and cfg["BLOCK_M"] >= M * topk
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, None, block_shape=block), out=out, config=cfg)
    assert rel_err(out, moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1, block_shape=block)) < 1e-2
