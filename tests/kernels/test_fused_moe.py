"""Fused MoE vs a float64 reference, every variant, under TRITON_INTERPRET=1 (CPU)."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
from moe_serve.bench.experts.reference import act_amax, moe_reference, quant_fp8, rel_err, routing

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
FP8_TOL_EXACT = 0.12     # vs. exact-activation reference (fp8 activation rounding ~4% rms)
FP8_TOL_QAWARE = 2e-2    # vs. reference that rounds activations through fp8 as the kernel does


def _cfg(bm: int, bn: int, bk: int, swap: bool, down_bn: int | None = None) -> dict:
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, num_warps=4, num_stages=2,
               SWAP_AB=swap)
    if down_bn:
        cfg["DOWN"] = dict(BLOCK_N=down_bn, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2,
                           SWAP_AB=not swap)
    return cfg


def _problem(M: int, E: int, N: int, K: int, topk: int, seed: int, ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    tw, ids = routing(M, E, topk, g, ids_dtype=ids_dtype)
    return x, w1, w2, tw, ids


CASES = [  # M, E, N, K, topk, config
    (1, 8, 32, 64, 2, _cfg(16, 64, 32, True)),
    (1, 8, 32, 64, 2, _cfg(16, 16, 32, False)),
    (7, 4, 48, 40, 2, _cfg(16, 64, 16, True)),            # K % BLOCK_K != 0, N % BN != 0
    (33, 16, 32, 64, 8, _cfg(32, 32, 64, False, 64)),      # split GEMM2 config (DOWN)
    (19, 64, 16, 32, 3, _cfg(16, 16, 32, True)),
    (130, 2, 32, 32, 1, _cfg(64, 32, 32, False)),
    (300, 8, 16, 32, 2, _cfg(128, 16, 32, False)),
]


@pytest.mark.parametrize("M,E,N,K,topk,cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float(M, E, N, K, topk, cfg, dtype):
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk, seed=M * 7 + E)
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    out = torch.full((M, K), float("nan"), dtype=dtype)
    fused_moe(x, w1, w2, tw, ids, out=out, config=cfg)
    assert rel_err(out, moe_reference(x, w1, w2, tw, ids)) < TOL[dtype]


FP8_CASES = [CASES[0], CASES[2], CASES[3], CASES[4]]


@pytest.mark.parametrize("M,E,N,K,topk,cfg", FP8_CASES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_fp8(M, E, N, K, topk, cfg, per_channel, static):
    _check_fp8(M, E, N, K, topk, cfg, per_channel, static, seed=M + 3 * E + per_channel)


def _check_fp8(M, E, N, K, topk, cfg, per_channel, static, seed):
    """fp8 W8A8 (per-tensor or per-channel weights; static or dynamic activation scales) against
    the float64 reference with the same quantization, and against the unquantized-activation one."""
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk, seed=seed)
    q1, s1 = quant_fp8(w1, per_channel)
    q2, s2 = quant_fp8(w2, per_channel)
    a1 = a2 = None
    if static:
        a1 = (x.abs().max() / 448.0).reshape(())
        a2 = (act_amax(x, q1.float() * s1.reshape(E, -1, 1), ids) / 448.0).float().reshape(())
    out = torch.full((M, K), float("nan"), dtype=torch.float32)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, a2), out=out, config=cfg)
    mode = "static" if static else "dynamic"
    qref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1, quant_acts=mode, a2_scale=a2)
    assert rel_err(out, qref) < FP8_TOL_QAWARE
    assert rel_err(out, moe_reference(x, q1, q2, tw, ids, s1, s2)) < FP8_TOL_EXACT


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_input_static(swap):
    """Hidden states already fp8 with a static a1 scale (A_MODE 1); output bf16."""
    M, E, N, K, topk = 5, 8, 32, 64, 2
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk, seed=11)
    q1, s1 = quant_fp8(w1, False)
    q2, s2 = quant_fp8(w2, True)
    a1 = (x.abs().max() / 448.0).reshape(())
    xq = (x / a1).to(torch.float8_e4m3fn)
    out = fused_moe(xq, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, None),
                    config=_cfg(16, 64 if swap else 32, 32, swap))
    assert out.dtype == torch.bfloat16
    ref = moe_reference(xq, q1, q2, tw, ids, s1, s2, a1_scale=a1)
    assert rel_err(out, ref) < FP8_TOL_EXACT


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_router_weight_on_input(swap, fp8):
    M, E, N, K = 9, 4, 32, 32
    x, w1, w2, tw, ids = _problem(M, E, N, K, 1, seed=5, ids_dtype=torch.int64)
    scales, ref_scales = None, (None, None)
    if fp8:
        w1, s1 = quant_fp8(w1, False)
        w2, s2 = quant_fp8(w2, False)
        scales, ref_scales = Fp8Scales(s1, s2), (s1, s2)
    out = torch.full((M, K), float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=scales, apply_router_weight_on_input=True, out=out,
              config=_cfg(16, 64 if swap else 16, 32, swap))
    ref = moe_reference(x, w1, w2, tw, ids, *ref_scales, on_input=True)
    assert rel_err(out, ref) < (FP8_TOL_EXACT if fp8 else 1e-5)


def test_default_config_path_and_repeats():
    """No explicit config (heuristic path); every token routed to the same experts."""
    M, E, N, K, topk = 40, 8, 32, 64, 2
    x, w1, w2, tw, _ = _problem(M, E, N, K, topk, seed=3)
    ids = torch.tensor([[3, 5]] * M, dtype=torch.int32)
    x, w1, w2 = x.half(), w1.half(), w2.half()
    out = fused_moe(x, w1, w2, tw, ids)
    assert rel_err(out, moe_reference(x, w1, w2, tw, ids)) < TOL[torch.float16]


def test_shape_errors():
    x, w1, w2, tw, ids = _problem(2, 4, 16, 32, 2, seed=1)
    with pytest.raises(ValueError):
        fused_moe(x, w1, w2.transpose(1, 2), tw, ids)
    with pytest.raises(ValueError):
        fused_moe(x, w1, w2, tw, ids, apply_router_weight_on_input=True)
    with pytest.raises(TypeError):
        fused_moe(x.half(), w1, w2, tw, ids)


# ---- split-K / un-fused gate+up (decode grid filling) ------------------------------------
def _split_cfg(bm: int, bn: int, bk: int, swap: bool, split1: int, fuse_gu: bool,
               split2: int, down_bn: int = 64, down_bk: int = 16) -> dict:
    cfg = _cfg(bm, bn, bk, swap)
    cfg.update(SPLIT_K=split1, FUSE_GU=fuse_gu)
    cfg["DOWN"] = dict(BLOCK_N=down_bn, BLOCK_K=down_bk, GROUP_M=1, num_warps=4, num_stages=2,
                       SWAP_AB=swap, SPLIT_K=split2)
    return cfg


SPLIT_CASES = [  # M, E, N, K, topk, config
    (1, 8, 32, 128, 2, _split_cfg(16, 64, 32, True, 4, False, 2)),       # both split, un-fused
    (3, 8, 48, 96, 2, _split_cfg(16, 64, 32, True, 2, True, 1)),         # gate+up tiles, atomics
    (5, 4, 40, 80, 3, _split_cfg(16, 32, 16, False, 4, False, 2, 32)),   # uneven + empty split
    (2, 16, 32, 64, 8, _split_cfg(16, 64, 16, True, 1, False, 1)),       # un-fused, no split
    (6, 4, 48, 64, 1, _split_cfg(16, 64, 32, True, 1, True, 4, 64, 16)), # GEMM2 split, topk 1
    (37, 8, 32, 64, 2, _split_cfg(32, 32, 16, False, 2, False, 2, 32)),  # many tokens/expert
]


@pytest.mark.parametrize("case,dtype", [(i, torch.float32) for i in range(len(SPLIT_CASES))]
                         + [(0, torch.float16), (2, torch.float16), (4, torch.float16)])
def test_split_k_float(case, dtype):
    M, E, N, K, topk, cfg = SPLIT_CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk, seed=M * 5 + E + N)
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    out = torch.full((M, K), float("nan"), dtype=dtype)
    fused_moe(x, w1, w2, tw, ids, out=out, config=cfg)
    assert rel_err(out, moe_reference(x, w1, w2, tw, ids)) < TOL[dtype]


@pytest.mark.parametrize("case,per_channel,static", [
    (0, False, False), (0, True, True), (2, True, False), (4, False, True), (4, True, False)])
def test_split_k_fp8(case, per_channel, static):
    M, E, N, K, topk, cfg = SPLIT_CASES[case]
    _check_fp8(M, E, N, K, topk, cfg, per_channel, static, seed=M + 11 * E + per_channel)


@pytest.mark.parametrize("fp8", [False, True])
def test_split_k_router_weight_on_input(fp8):
    M, E, N, K = 4, 4, 32, 64
    x, w1, w2, tw, ids = _problem(M, E, N, K, 1, seed=9)
    scales, ref_scales = None, (None, None)
    if fp8:
        w1, s1 = quant_fp8(w1, True)
        w2, s2 = quant_fp8(w2, False)
        scales, ref_scales = Fp8Scales(s1, s2), (s1, s2)
    out = torch.full((M, K), float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=scales, apply_router_weight_on_input=True, out=out,
              config=_split_cfg(16, 64, 16, True, 2, False, 2))
    ref = moe_reference(x, w1, w2, tw, ids, *ref_scales, on_input=True)
    assert rel_err(out, ref) < (FP8_TOL_EXACT if fp8 else 1e-5)


def test_aligned_heuristic_splits_at_small_m():
    """The aligned path's own heuristic fills >= ~1 wave (split-K / un-fused gate+up) at
    small M and never splits at large M."""
    from moe_serve.kernels.moe import heuristics
    from moe_serve.kernels.moe.fused_moe import num_programs

    for E, N, K, topk in [(8, 1792, 4096, 2), (256, 256, 7168, 8), (128, 96, 2048, 8)]:
        for dt in ("bf16", "fp8"):
            cfg = heuristics.aligned_config(1, E, N, K, topk, dt)
            g1, g2 = num_programs(1, E, N, K, topk, cfg)
            assert g1 >= 96 and g2 >= 132, (E, dt, g1, g2, cfg)
        big = heuristics.aligned_config(4096, E, N, K, topk, "bf16")
        assert big["SPLIT_K"] == 1 and big["FUSE_GU"] and big["DOWN"]["SPLIT_K"] == 1


def test_act_amax_is_the_max_over_routed_pairs():
    """The reference's static-a2 amax (per expert, bounded memory) equals the all-pairs
    definition max |silu(W1g[e] x_m) * W1u[e] x_m| over (m, e) routed, on fresh inputs."""
    x, w1, _, _, ids = _problem(M=37, E=8, N=24, K=32, topk=2, seed=torch.seed() % 2 ** 31)
    h = torch.einsum("mk,mjnk->mjn", x.double(), w1.double()[ids.long()])   # [M, topk, 2N]
    want = (torch.nn.functional.silu(h[..., :24]) * h[..., 24:]).abs().max()
    torch.testing.assert_close(act_amax(x, w1, ids), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", [CASES[2], CASES[3], SPLIT_CASES[0], SPLIT_CASES[4]])
def test_aligned_path_quantizes_activations_once_by_default(case):
    """The aligned path's default (A_PREQUANT): x quantized once by a launch before GEMM1 (static
    a1: A_MODE 1; dynamic: per-token scales, A_MODE 4), and a dynamic GEMM2 input once more
    after a fused GEMM1 (a static one is quantized in GEMM1's epilogue); the K-loop variant
    (A_PREQUANT false) launches no quant kernel. Both round alike (same fp8 values) and match
    the float64 reference."""
    from moe_serve.kernels.moe.launch import kernel_name, record_launches

    M, E, N, K, topk, cfg = case
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk, seed=M + 5 * E)
    q1, s1 = quant_fp8(w1, False)
    q2, s2 = quant_fp8(w2, True)
    a1 = (x.abs().max() / 448.0).reshape(())
    a2 = (act_amax(x, q1.float() * s1.reshape(E, -1, 1), ids) / 448.0).float().reshape(())
    inloop = {**cfg, "A_PREQUANT": False}
    fused1 = cfg.get("SPLIT_K", 1) == 1 and cfg.get("FUSE_GU", True)
    for a1s, a2s, n_quant in ((a1, a2, 1), (None, None, 1 + fused1)):
        scales = Fp8Scales(s1, s2, a1s, a2s)
        for c, want in ((cfg, n_quant), (inloop, 0)):
            with record_launches() as launches:
                fused_moe(x, q1, q2, tw, ids, fp8=scales, config=c)
            assert [kernel_name(k) for k, *_ in launches].count("quant_fp8_kernel") == want
        outs = []
        for c in (inloop, cfg):
            out = torch.full((M, K), float("nan"), dtype=torch.float32)
            outs.append(fused_moe(x, q1, q2, tw, ids, fp8=scales, out=out, config=c))
        assert rel_err(outs[1], outs[0].double()) < 1e-6
        mode = "static" if a1s is not None else "dynamic"
        qref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1s, quant_acts=mode,
                             a2_scale=a2s)
        assert rel_err(outs[1], qref) < FP8_TOL_QAWARE


VLLM_BM32_TILE = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                  "num_warps": 4, "num_stages": 3}


@pytest.mark.parametrize("per_channel,static", [(False, True), (True, False)])
def test_fp8_config_from_vllms_block_m_32_tile(per_channel, static):
    """The untuned FP8 aligned config mapped from vLLM's BLOCK_SIZE_M = 32 tile (both GEMMs
    swapped, 64-row weight tiles): per-tensor static and per-channel weights with per-token
    dynamic activations, against the float64 reference."""
    from moe_serve.kernels.moe.heuristics import from_vllm_config

    cfg = from_vllm_config(VLLM_BM32_TILE, "fp8")
    assert cfg["SWAP_AB"] and cfg["DOWN"]["SWAP_AB"] and cfg["BLOCK_N"] == 64
    _check_fp8(40, 16, 64, 128, 8, cfg, per_channel, static, seed=5 + per_channel)
