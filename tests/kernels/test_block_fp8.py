"""Block-scaled FP8 ([bn, bk] weight blocks, activations per token per bk columns) and per-token
dynamic FP8 (FP8-dynamic) through both paths, against the float64 reference, under
TRITON_INTERPRET=1: fresh random inputs every run, NaN-poisoned outputs."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe import heuristics
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
from moe_serve.kernels.moe.launch import kernel_name, record_launches
from moe_serve.bench.experts.reference import (as_kernel_bf16, moe_reference, quant_act_groups, quant_fp8, quant_fp8_block, rel_err,
                       routing)

FP8 = torch.float8_e4m3fn
TOL_QAWARE = 2e-2   # vs the reference that rounds activations through fp8 as the kernel does
TOL_EXACT = 0.12    # vs the reference with exact activations


def _problem(M: int, E: int, N: int, K: int, topk: int):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    tw, ids = routing(M, E, topk, g)
    return x, w1, w2, tw, ids


def _aligned(bm: int, bn: int, bk: int, swap: bool, pre: bool, down_bn: int, split: int = 1) -> dict:
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, num_warps=4, num_stages=2,
               SWAP_AB=swap, A_PREQUANT=pre,
               DOWN=dict(BLOCK_N=down_bn, BLOCK_K=bk, SWAP_AB=swap, SPLIT_K=split))
    if split > 1:
        cfg.update(SPLIT_K=split, FUSE_GU=False)
    return cfg


def _decode(M: int, topk: int, bn: int, bk: int, swap: bool, pre: bool, down_bn: int,
            down_swap: bool) -> dict:
    return {"DECODE": True, "PDL": True, "BLOCK_M": heuristics.decode_block_m(M, topk),
            "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
            "SWAP_AB": swap, "A_PREQUANT": pre,
            "DOWN": {"BLOCK_N": down_bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4,
                     "num_stages": 2, "SWAP_AB": down_swap}}


def _block_check(M, E, N, K, topk, block, cfg, x_fp8=False, ids=None):
    """Block FP8 through `cfg` vs the float64 references (group-rounded and exact)."""
    x, w1, w2, tw, rids = _problem(M, E, N, K, topk)
    ids = rids if ids is None else ids
    bn, bk = block
    q1, s1 = quant_fp8_block(w1, bn, bk)
    q2, s2 = quant_fp8_block(w2, bn, bk)
    a1 = None
    if x_fp8:                       # as vLLM's prepare step hands them over
        x, a1 = quant_act_groups(x, bk)
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16 if x_fp8 else torch.float32)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, block_shape=block), out=out, config=cfg)
    kw = dict(w1_scale=s1, w2_scale=s2, a1_scale=a1, block_shape=block)
    qref = moe_reference(x, q1, q2, tw, ids, quant_acts="group", **kw)
    assert rel_err(out, qref) < TOL_QAWARE, rel_err(out, qref)
    assert rel_err(out, moe_reference(x, q1, q2, tw, ids, **kw)) < TOL_EXACT
    return out


# M, E, N, K, topk, block (bn, bk): K and N not multiples of the block, bn != bk, blocks
# shared by gate and up rows (N % bn != 0, as vLLM's kernel indexes them: row // bn of 2N)
SHAPES = [
    (1, 8, 40, 72, 2, (24, 32)),
    (3, 8, 64, 96, 1, (32, 32)),
    (2, 16, 48, 64, 8, (16, 16)),
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("variant", ["plain", "swap-prequant", "epilogue-quant", "split"])
def test_block_decode(shape, variant):
    """Decode path: swap on/off, x quantized in the K loop or once (A_PREQUANT), act quantized
    in the up kernel's epilogue (BLOCK_N a multiple of bk) or by the down kernel on load;
    split-K in both kernels (block-scaled partials, the epilogue quantization by the tile's
    last program)."""
    M, E, N, K, topk, block = SHAPES[shape]
    bk = block[1]
    cfg = {"plain": _decode(M, topk, 16, bk, False, False, 16, False),
           "swap-prequant": _decode(M, topk, 64, bk, True, True, 64, True),
           "epilogue-quant": _decode(M, topk, 2 * bk, bk, False, False, 32, True),
           "split": _decode(M, topk, bk, bk, False, False, 16, False)}[variant]
    if variant == "split":
        cfg.update(SPLIT_K=2, DOWN={**cfg["DOWN"], "SPLIT_K": 2})
    _block_check(M, E, N, K, topk, block, cfg)


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("variant", ["plain", "swap-inloop", "split"])
def test_block_aligned(shape, variant):
    """Aligned path: swap on/off; quantize-once (default: x by a prologue launch, act in
    GEMM1's epilogue when its tile holds whole groups) or in the K loop; split-K with
    un-fused gate/up (block-scaled partials summed by atomics, SiLU + group quant on load)."""
    M, E, N, K, topk, block = SHAPES[shape]
    bk = block[1]
    cfg = {"plain": _aligned(16, bk, bk, False, True, 32),
           "swap-inloop": _aligned(16, 64, bk, True, False, 64),
           "split": _aligned(16, 64, bk, True, True, 64, split=2)}[variant]
    _block_check(M, E, N, K, topk, block, cfg)


@pytest.mark.parametrize("path", ["decode", "aligned"])
def test_block_fp8_hidden_states(path):
    """Hidden states already fp8 with per-token-group scales (what vLLM's prepare step hands
    the experts): A_MODE 5, bf16 output."""
    M, E, N, K, topk, block = 4, 8, 48, 80, 2, (32, 32)
    cfg = (_decode(M, topk, 32, 32, False, False, 16, False) if path == "decode"
           else _aligned(16, 64, 32, True, True, 64))
    out = _block_check(M, E, N, K, topk, block, cfg, x_fp8=True)
    assert out.dtype == torch.bfloat16


def test_block_many_tokens_and_topk_1():
    """Aligned path at more tokens than a tile (several blocks per expert), topk 1 (GEMM2
    writes out directly), BLOCK_M 32."""
    _block_check(40, 4, 32, 64, 1, (32, 32), _aligned(32, 32, 32, False, True, 32))
    _block_check(33, 8, 40, 48, 2, (16, 16), _aligned(32, 64, 16, False, True, 64))


def test_block_decode_non_local_experts():
    """Expert id -1 (not on this rank) contributes nothing, tokens share experts."""
    M, E, N, K, topk = 4, 8, 32, 64, 2
    ids = torch.tensor([[3, 5], [5, 3], [3, -1], [-1, 5]], dtype=torch.int32)
    _block_check(M, E, N, K, topk, (32, 32), _decode(M, topk, 32, 32, False, False, 16, False),
                 ids=ids)


def test_block_m_up_to_64():
    """Decode path with every M whose slots fit BLOCK_M 64 at topk 1, up to M = 64."""
    for M in (1, 2, 5, 17, 64):
        _block_check(M, 64, 32, 32, 1, (32, 32), _decode(M, 1, 32, 32, False, False, 32, False))


def test_block_quantize_once_equals_in_loop():
    """The prologue quantization (A_PREQUANT) rounds exactly as the K loop's, in both paths,
    with the quant launch counted: one per quantized-once operand."""
    M, E, N, K, topk, block = 3, 8, 48, 64, 2, (32, 32)
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8_block(w1, *block)
    q2, s2 = quant_fp8_block(w2, *block)
    fp8 = Fp8Scales(s1, s2, block_shape=block)
    for make, quants in ((lambda pre: _decode(M, topk, 16, 32, False, pre, 16, False), 1),
                         (lambda pre: _aligned(16, 16, 32, False, pre, 32), 2)):
        outs = []
        for pre in (False, True):
            with record_launches() as launches:
                fused_moe(x, q1, q2, tw, ids, fp8=fp8, config=make(pre))
            n = [kernel_name(k) for k, *_ in launches].count("quant_fp8_kernel")
            assert n == (quants if pre else 0), (pre, n)
            outs.append(fused_moe(x, q1, q2, tw, ids, fp8=fp8, config=make(pre)))
        assert rel_err(outs[1], outs[0].double()) < 1e-6


def test_block_needs_block_k_equal_to_the_group():
    M, E, N, K, topk = 2, 4, 32, 64, 2
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8_block(w1, 32, 32)
    q2, s2 = quant_fp8_block(w2, 32, 32)
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, block_shape=(32, 32)),
                  config=_aligned(16, 32, 64, False, True, 32))
    with pytest.raises(ValueError, match="w1_scale"):
        fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1[:, :1], s2, block_shape=(32, 32)),
                  config=_aligned(16, 32, 32, False, True, 32))
    with pytest.raises(ValueError, match="power of two"):
        fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, block_shape=(32, 24)))


def test_block_default_configs():
    """No config: the format's table/default (decode for few tokens per expert, aligned above)
    with BLOCK_K = the group, through both paths."""
    from moe_serve.kernels.moe import configs, quant_format, selection

    key = quant_format.block_key(32, 32)
    assert selection.get_config(1, 8, 32, 64, 2, key, device="cpu").get("DECODE")
    assert not selection.get_config(64, 8, 32, 64, 2, key, device="cpu").get("DECODE")
    for M in (1, 64):
        cfg = selection.get_config(M, 8, 32, 64, 2, key, device="cpu")
        assert configs.block_k_of(cfg) == {32}
        _block_check(M, 8, 32, 64, 2, (32, 32), None)
    for M in configs.M_BUCKETS:     # DeepSeek-V3 TP8 shard: every bucket's config launchable
        cfg = selection.get_config(M, 256, 256, 7168, 8, quant_format.block_key(128, 128), "cpu")
        assert configs.block_k_of(cfg) == {128}


# ---- per-token dynamic activations, per-channel weights (FP8-dynamic) ---------------------
@pytest.mark.parametrize("path,pre", [("decode", False), ("decode", True), ("aligned", True),
                                      ("aligned", False)])
@pytest.mark.parametrize("x_fp8", [False, True])
def test_per_token(path, pre, x_fp8):
    """Per-channel weights, activations quantized per token (x: in the K loop, once by a
    prologue, or already fp8 with [M, 1] scales; act: per slot, once or on load)."""
    M, E, N, K, topk = 3, 8, 40, 72, 2
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8(w1, True)
    q2, s2 = quant_fp8(w2, True)
    a1 = None
    if x_fp8:
        a1 = (x.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-10)
        x = (x / a1).to(FP8)
    cfg = (_decode(M, topk, 32, 32, pre, pre, 16, False) if path == "decode"
           else _aligned(16, 32, 32, False, pre, 32))
    if path == "decode" and pre:
        cfg.update(SWAP_AB=True, BLOCK_N=64)
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16 if x_fp8 else torch.float32)
    fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, per_token_act=True), out=out,
              config=cfg)
    # act stays in the output dtype (bf16 for fp8 x) and GEMM2 quantizes it per token on load
    qref = moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1, quant_acts="dynamic",
                         act_round=as_kernel_bf16 if x_fp8 else None)
    assert rel_err(out, qref) < TOL_QAWARE
    assert rel_err(out, moe_reference(x, q1, q2, tw, ids, s1, s2, a1_scale=a1)) < TOL_EXACT


def test_per_token_scale_layouts_are_checked():
    M, E, N, K, topk = 2, 4, 16, 32, 2
    x, w1, w2, tw, ids = _problem(M, E, N, K, topk)
    q1, s1 = quant_fp8(w1, True)
    q2, s2 = quant_fp8(w2, True)
    with pytest.raises(ValueError, match="a1_scale"):    # fp8 x needs its per-token scales
        fused_moe(x.to(FP8), q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, torch.ones(()),
                                                            per_token_act=True))
    with pytest.raises(ValueError, match="dynamic"):
        fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, None, torch.ones(()),
                                                    per_token_act=True))


def test_variants_compile_for_sm90_with_wgmma_where_swapped():
    """Every block-FP8 and per-token variant of both paths compiles for sm_90 (the bundled
    ptxas, no GPU) within shared memory; swapped tiles run fp8 wgmma (QGMMA in the SASS)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_fp8_sm90.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    gemms = [r for r in rows if r["kernel"] in ("moe_gemm_kernel", "moe_decode_up_kernel",
                                                "moe_decode_down_kernel")]
    assert len({r["variant"] for r in rows}) == 8 and len(gemms) == 16
    assert all(r["mma"] == "QGMMA" for r in gemms if r["swap"]), gemms
    assert all(0 < r["smem"] <= 232448 for r in gemms)
    modes = {(r["a_mode"], r["w_scale"], r["c_quant"]) for r in gemms}
    for want in ((6, 3, 0), (5, 3, 2), (5, 3, 0), (4, 2, 0), (3, 2, None)):
        assert want in modes, (want, modes)
    assert {r["scale"] for r in rows if r["kernel"] == "quant_fp8_kernel"} == {1, 2}
    # decode configs have PDL: the up kernel releases the down kernel, a dependent launch that
    # waits for it; chained, the up kernel is a dependent launch too and waits first
    decode = [r for r in gemms if r["kernel"].startswith("moe_decode")]
    up = [r for r in decode if r["kernel"] == "moe_decode_up_kernel"]
    chained = [r for r in up if r["variant"].endswith("-chained")]
    assert len(chained) == 1 and chained[0]["launch_pdl"] and chained[0]["gdc_wait"], chained
    assert all(r["gdc_launch"] and not r["launch_pdl"] and not r["gdc_wait"]
               for r in up if r not in chained), up
    assert all(r["launch_pdl"] and r["gdc_wait"] and not r["gdc_launch"]
               for r in decode if r not in up), decode
    assert not any(r["launch_pdl"] or r["gdc_wait"] or r["gdc_launch"] for r in rows if r not in decode)
