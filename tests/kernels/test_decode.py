"""The two-launch decode path (moe_serve.kernels.moe.moe_decode) against the float64 reference, under
TRITON_INTERPRET=1: every variant, into NaN-poisoned outputs, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe import heuristics
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
from moe_serve.bench.experts.reference import act_amax, moe_reference, quant_fp8, rel_err, routing

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _cfg(M: int, topk: int, bn: int, bk: int, swap: bool, down_bn: int, down_bk: int,
         down_swap: bool, split: int = 1, down_split: int = 1) -> dict:
    return {"DECODE": True, "PDL": True, "BLOCK_M": heuristics.decode_block_m(M, topk),
            "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
            "SWAP_AB": swap, "SPLIT_K": split,
            "DOWN": {"BLOCK_N": down_bn, "BLOCK_K": down_bk, "GROUP_M": 1, "num_warps": 4,
                     "num_stages": 2, "SWAP_AB": down_swap, "SPLIT_K": down_split}}


def _problem(M: int, E: int, N: int, K: int, topk: int, ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)     # fresh inputs every run
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    tw, ids = routing(M, E, topk, g, ids_dtype=ids_dtype)
    return x, w1, w2, tw, ids


CASES = [  # M, E, N, K, topk, (up BN, BK, swap), (down BN, BK, swap)
    (1, 8, 32, 64, 2, (32, 32, False), (64, 32, True)),
    (1, 8, 32, 64, 2, (64, 32, True), (16, 32, False)),
    (3, 8, 40, 72, 2, (16, 32, False), (16, 16, False)),    # N % BN, K % BK, N % BK != 0
    (2, 16, 24, 48, 4, (64, 16, True), (64, 32, True)),     # 2 tokens x 4 slots, odd N
    (4, 8, 16, 32, 2, (16, 16, False), (32, 16, False)),    # every expert hit once
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_float(case, dtype):
    M, E, N, K, topk, up, down = CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    out = torch.full((M, K), float("nan"), dtype=dtype)
    fused_moe(x, w1, w2, tw, ids, out=out, config=_cfg(M, topk, *up, *down))
    assert rel_err(out, moe_reference(x, w1, w2, tw, ids)) < TOL[dtype]


@pytest.mark.parametrize("case", [0, 2, 3])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_decode_fp8(case, per_channel, static):
    """W8A8: static a2 quantizes act once in the up kernel's epilogue; dynamic: per-slot
    absmax pre-pass in the down kernel."""
    M, E, N, K, topk, up, down = CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8(w1, per_channel)
    q2, s2 = quant_fp8(w2, per_channel)
    a1 = a2 = None
    if static:
        a1 = (x.abs().max() / 448.0).reshape(())
        a2 = (act_amax(x, q1.float() * s1.reshape(E, -1, 1), ids) / 448.0).float().reshape(())
    out = torch.full((M, K), float("nan"))
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, a2), out=out,
              config=_cfg(M, topk, *up, *down))
    qref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1,
                         quant_acts="static" if static else "dynamic", a2_scale=a2)
    assert rel_err(out, qref) < 2e-2
    assert rel_err(out, moe_reference(x, q1, q2, tw, ids, s1, s2)) < 0.12


SPLITS = [(2, 1), (1, 2), (4, 8), (8, 4)]  # (up, down): more splits than tiles leaves some empty


def _split_ws_zero() -> bool:
    from moe_serve.kernels.moe import moe_decode_launch as fm
    return all(not (f.any() or c.any()) for f, c in fm._SPLIT_WS.values())


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("case", [0, 2, 3, 4])
def test_decode_split_k(case, splits):
    """Split-K in either kernel: partials added with atomics, the tile's last program runs the
    epilogue; the workspace is zero again afterwards and a second call gives the same sums."""
    M, E, N, K, topk, up, down = CASES[case]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    cfg = _cfg(M, topk, *up, *down, *splits)
    ref = moe_reference(x, w1, w2, tw, ids)
    for _ in range(2):
        out = torch.full((M, K), float("nan"))
        fused_moe(x, w1, w2, tw, ids, out=out, config=cfg)
        assert rel_err(out, ref) < TOL[torch.float32]
        assert _split_ws_zero()


@pytest.mark.parametrize("static", [False, True])
def test_decode_split_k_fp8(static):
    """fp8 W8A8 with both kernels split: scales are applied to the reduced sums (up) or per
    slot row before the partial is added (down)."""
    M, E, N, K, topk, up, down = CASES[3]
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8(w1, True)
    q2, s2 = quant_fp8(w2, False)
    a1 = a2 = None
    if static:
        a1 = (x.abs().max() / 448.0).reshape(())
        a2 = (act_amax(x, q1.float() * s1.reshape(E, -1, 1), ids) / 448.0).float().reshape(())
    out = torch.full((M, K), float("nan"))
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, a2), out=out,
              config=_cfg(M, topk, *up, *down, 2, 4))
    qref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1,
                         quant_acts="static" if static else "dynamic", a2_scale=a2)
    assert rel_err(out, qref) < 2e-2
    assert _split_ws_zero()


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_router_weight_on_input(fp8):
    M, E, N, K = 5, 4, 32, 32
    x, w1, w2, tw, ids = _problem(M, E, N, K, 1, ids_dtype=torch.int64)
    scales, ref_scales = None, (None, None)
    if fp8:
        w1, s1 = quant_fp8(w1, False)
        w2, s2 = quant_fp8(w2, True)
        scales, ref_scales = Fp8Scales(s1, s2), (s1, s2)
    out = torch.full((M, K), float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=scales, apply_router_weight_on_input=True, out=out,
              config=_cfg(M, 1, 16, 16, False, 32, 16, False))
    ref = moe_reference(x, w1, w2, tw, ids, *ref_scales, on_input=True)
    assert rel_err(out, ref) < (0.12 if fp8 else 1e-5)


def test_decode_repeated_experts_and_non_local_ids():
    """Tokens sharing experts (one up-kernel program per expert serves all its slots), and
    expert id -1 (a non-local expert under expert parallelism) contributing nothing."""
    M, E, N, K, topk = 4, 8, 32, 64, 2
    x, w1, w2, tw, _ = _problem(M, E, N, K, topk)
    ids = torch.tensor([[3, 5], [5, 3], [3, -1], [-1, 5]], dtype=torch.int32)
    out = torch.full((M, K), float("nan"))
    fused_moe(x, w1, w2, tw, ids, out=out, config=_cfg(M, topk, 16, 32, False, 16, 32, False))
    local = ids >= 0
    ref = moe_reference(x, w1, w2, tw * local, ids.clamp(min=0))
    assert rel_err(out, ref) < 1e-5


def test_decode_block_m_must_hold_all_slots():
    M, E, N, K, topk = 9, 8, 16, 32, 2
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    with pytest.raises(ValueError, match="BLOCK_M"):
        fused_moe(x, w1, w2, tw, ids, config=_cfg(8, topk, 16, 16, False, 16, 16, False))


def test_default_path_choice():
    """Untuned shapes: decode while M * topk <= min(32, E), else the aligned path."""
    from moe_serve.kernels.moe import configs, selection

    assert configs.default_config(1, 8, 1792, 4096, 2, "bf16").get("DECODE")
    assert configs.default_config(4, 8, 1792, 4096, 2, "bf16").get("DECODE")
    assert not configs.default_config(8, 8, 1792, 4096, 2, "bf16").get("DECODE")
    assert configs.default_config(4, 128, 96, 2048, 8, "fp8").get("DECODE")
    assert not configs.default_config(8, 128, 96, 2048, 8, "fp8").get("DECODE")
    for M in (1, 2, 4):
        cfg = selection.get_config(M, 256, 256, 7168, 8, "bf16", device="cpu")
        assert cfg["BLOCK_M"] >= M * 8
