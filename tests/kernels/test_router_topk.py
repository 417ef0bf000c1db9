"""The one-launch MoE router (moe_serve.kernels.moe.router_topk) against a float64 reference and vLLM's own
CPU router, on fresh random inputs into poisoned outputs, under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe.moe_decode_launch import split_workspace
from moe_serve.kernels.moe.router_topk import TOPK_METHODS, launch_plan, router_topk


def _inputs(M: int, E: int, K: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(E, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.rand(E, generator=g) * 0.2 if bias else None
    return x, w, b


def _reference(x, w, scoring, bias):
    """(score, choice key) [M, E] in float64."""
    logits = x.double() @ w.double().T
    score = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    return score, score + (bias.double() if bias is not None else 0)


def _poisoned(M: int, topk: int):
    return torch.full((M, topk), float("nan")), torch.full((M, topk), -7, dtype=torch.int32)


def _check(x, w, topk, scoring, renorm, bias, scaling, tw, ids):
    """ids: topk distinct experts whose choice keys are the reference's top-k (up to float
    rounding at a near-tie); weights: the reference's scores at those ids, renormalised, scaled."""
    E = w.shape[0]
    score, key = _reference(x, w, scoring, bias)
    assert ids.dtype == torch.int32 and ((ids >= 0) & (ids < E)).all()
    assert all(len(set(r)) == topk for r in ids.tolist())
    ours = key.gather(1, ids.long()).sort(-1, descending=True).values
    best = key.topk(topk, -1).values
    assert torch.allclose(ours, best, rtol=0, atol=1e-6), (ours, best)
    want = score.gather(1, ids.long())
    if renorm:
        want = want / want.sum(-1, keepdim=True)
    want = want * scaling
    assert tw.dtype == torch.float32 and torch.allclose(tw.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("M,E,K,topk", [(1, 8, 256, 2), (1, 128, 512, 8), (3, 60, 200, 4),
                                        (2, 256, 96, 8), (130, 16, 64, 2), (1, 1, 32, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("method", TOPK_METHODS)
def test_softmax_topk(M, E, K, topk, dtype, method):
    x, w, _ = _inputs(M, E, K, dtype, False)
    for renorm in (True, False):
        tw, ids = _poisoned(M, topk)
        router_topk(x, w, topk, "softmax", renorm, out=(tw, ids), method=method)
        _check(x, w, topk, "softmax", renorm, None, 1.0, tw, ids)


@pytest.mark.parametrize("M,E,K,topk", [(1, 64, 256, 6), (4, 72, 128, 8)])
@pytest.mark.parametrize("method", TOPK_METHODS)
def test_sigmoid_with_correction_bias_and_scaling(M, E, K, topk, method):
    x, w, b = _inputs(M, E, K, torch.float32, True)
    tw, ids = _poisoned(M, topk)
    router_topk(x, w, topk, "sigmoid", True, bias=b, scaling=2.5, out=(tw, ids), method=method)
    _check(x, w, topk, "sigmoid", True, b, 2.5, tw, ids)
    # the bias moves the choice, not the weights: without it, another set for some token
    tw0, ids0 = router_topk(x, w, topk, "sigmoid", True, scaling=2.5, method=method)
    _check(x, w, topk, "sigmoid", True, None, 2.5, tw0, ids0)


@pytest.mark.parametrize("M,E,K,topk", [(1, 128, 256, 8), (3, 60, 64, 6), (2, 8, 64, 2)])
def test_sort_picks_the_same_experts_in_the_same_order_as_rounds(M, E, K, topk):
    """Bit-equal ids and weights from both methods, with a tie at the top (experts 2 and 3 share a
    gate row aligned with every token: both picked first, the lower one first) and negative choice
    values (a bias below minus the sigmoid)."""
    x, w, _ = _inputs(M, E, K, torch.float32, False)
    w[2] = w[3] = 4 * x.sum(0) / x.sum(0).norm()                  # the largest logit of every token
    bias = -1.5 * torch.rand(E)
    bias[2] = bias[3] = 0.0
    for scoring, b in (("softmax", None), ("sigmoid", bias)):
        (tw_r, ids_r), (tw_s, ids_s) = (router_topk(x, w, topk, scoring, bias=b, method=m) for m in TOPK_METHODS)
        assert torch.equal(ids_r, ids_s) and torch.equal(tw_r, tw_s), (scoring, ids_r, ids_s)
        assert ids_s[:, :2].tolist() == [[2, 3]] * M, ids_s


def test_split_workspace_is_zero_after_each_call_and_calls_repeat():
    M, E, K, topk = 2, 128, 1024, 8
    assert launch_plan(M, E, K)[2] > 1                       # the split path
    x, w, _ = _inputs(M, E, K, torch.float32, False)
    first = router_topk(x, w, topk)
    ws, cnt = split_workspace(x.device, M * 128, M)
    assert not ws.any() and not cnt.any()
    again = router_topk(x, w, topk)
    assert torch.equal(first[1], again[1]) and torch.equal(first[0], again[0])


def test_matches_vllms_cpu_router():
    """vLLM's own top-k on the CPU (one expert group: plain top-k) on our logits' inputs."""
    cpu_router = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.cpu_router")
    M, E, K, topk = 3, 64, 256, 8
    x, w, b = _inputs(M, E, K, torch.float32, True)
    logits = x @ w.T
    for scoring, bias, scaling in (("softmax", None, 1.0), ("sigmoid", b, 2.5)):
        vw, vids = cpu_router._grouped_topk(logits, topk, True, 1, 1, scoring, scaling, bias)
        tw, ids = router_topk(x, w, topk, scoring, True, bias=bias, scaling=scaling)
        order, vorder = ids.long().sort(-1), vids.long().sort(-1)
        assert torch.equal(order.values, vorder.values)
        assert torch.allclose(tw.gather(1, order.indices), vw.gather(1, vorder.indices), rtol=1e-5)


def test_bad_arguments_are_refused():
    x, w, _ = _inputs(2, 8, 64, torch.float32, False)
    with pytest.raises(ValueError, match="topk"):
        router_topk(x, w, 9)
    with pytest.raises(ValueError, match="scoring"):
        router_topk(x, w, 2, "softplus")
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        router_topk(x[:, :32], w, 2)
    with pytest.raises(ValueError, match="bias"):
        router_topk(x, w, 2, bias=torch.zeros(7))
    with pytest.raises(ValueError, match="out"):
        router_topk(x, w, 2, out=(torch.empty(2, 2), torch.empty(2, 2)))
    with pytest.raises(ValueError, match="method"):
        router_topk(x, w, 2, method="heap")


def test_variants_compile_for_sm90():
    """Both paths (split with the arrival counter, one program per token) compile for sm_90 with
    the bundled ptxas, for bf16 gates of the served model families' sizes, one adding the expert
    load, one with the sort top-k; so does the expert count kernel, for int32 and int64 ids. The
    gate streams 16 bytes a load (hidden size and expert count specialized: their masks' constancy
    known), never two at a time."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    def compiled(block_pdl: str) -> list[dict]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        res = subprocess.run([sys.executable, str(Path(__file__).with_name("_router_sm90.py"))],
                             env={**env, "MOE_SERVE_BLOCK_PDL": block_pdl},
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]

    rows = compiled("0")
    counting = [r for r in rows if r["kernel"] == "count_experts_kernel"]   # moe_serve.kernels.moe.expert_count
    assert len(counting) == 2 and all(r["atomics"] >= 1 for r in counting), counting
    rows = [r for r in rows if r not in counting]
    assert len(rows) == 7 and {r["kernel"] for r in rows} == {"router_topk_kernel"}
    assert {r["one_program"] for r in rows} == {True, False} and sum(r["count"] for r in rows) == 2
    assert all(r["grid"][0] * r["grid"][1] * r["grid"][2] >= 64 for r in rows if not r["one_program"])
    assert all(r["wide_loads"] > 0 for r in rows), rows
    assert not any(r["launch_pdl"] or r["gdc"] for r in rows), rows      # launched plainly
    # with the block chained (sm_90 is the target here, no CUDA device), each is a programmatic
    # dependent launch that waits for the kernel before it and lets the next one launch
    chained = [r for r in compiled("1") if r["kernel"] == "router_topk_kernel"]
    assert len(chained) == 7 and all(r["launch_pdl"] and len(r["gdc"]) == 2 for r in chained), chained
