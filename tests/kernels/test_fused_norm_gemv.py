"""Residual add + RMSNorm fused into the decode GEMV (moe_serve.kernels.fused.norm_gemv) and the row-norm
kernel of its unfused side (moe_serve.kernels.fused.rms_norm), under TRITON_INTERPRET=1, fp16 and fp32,
fresh random inputs, outputs poisoned with NaN (the launcher allocates them: poisoned through
torch.empty's allocator below), against a float64 reference and against vLLM's own
RMSNorm.forward_native followed by the linear layer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.fused import norm_gemv as ng
from moe_serve.kernels.fused import rms_norm
from moe_serve.kernels.moe import moe_decode_launch
from tests.kernels._fused_vllm import TOL, close, generator, vllm_config, vllm_rms_norm

EPS = 1e-6


@pytest.fixture(autouse=True)
def _poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor the launchers allocate starts as NaN (torch.empty / empty_like), so an
    output element the kernel fails to write fails the checks."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def _inputs(M: int, N: int, K: int, dtype: torch.dtype, residual: bool, bias: bool):
    g = generator()
    x = torch.randn(M, K, generator=g).to(dtype)
    r = (2 * torch.randn(M, K, generator=g)).to(dtype) if residual else None
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, r, nw, w, b


def _float64(x, r, nw, w, b):
    """(y, residual_out, h) in float64, no intermediate rounding."""
    s = x.double() + (r.double() if r is not None else 0.0)
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
    return h @ w.double().T + (b.double() if b is not None else 0.0), s, h


def _check(M: int, N: int, K: int, dtype: torch.dtype, residual: bool, bias: bool, write_h: bool,
           cfg: dict | None = None, exact_h: bool = True) -> None:
    """exact_h: the GEMV's operand is h as vLLM rounds it (y within TOL / 2 of vLLM's layer's),
    else s * w with rstd on the sums (about one more rounding: within TOL)."""
    x, r, nw, w, b = _inputs(M, N, K, dtype, residual, bias)
    x0, r0 = x.clone(), None if r is None else r.clone()
    y, res_out, h = ng.norm_gemv(x, r, nw, EPS, w, b, write_h=write_h, cfg=cfg, exact_h=exact_h)
    assert torch.equal(x, x0) and (r is None or torch.equal(r, r0)), "inputs written"
    assert (res_out is None) == (r is None) and (h is None) == (not write_h)
    y64, s64, h64 = _float64(x, r, nw, w, b)
    assert not y.isnan().any() and rel_err(y, y64) < TOL[dtype]
    assert ((y.double() - y64).abs() / (y64.abs() + y64.abs().mean())).max() < 4 * TOL[dtype]
    with vllm_config():                       # vLLM's layer: RMSNorm.forward_native, then the linear
        out = vllm_rms_norm(nw, EPS).forward_native(x.clone(), None if r is None else r.clone())
    h_v, res_v = out if r is not None else (out, x)
    y_v = h_v.double() @ w.double().T + (b.double() if b is not None else 0.0)
    assert rel_err(y, y_v) < TOL[dtype] / (2 if exact_h else 1)
    if r is not None:
        assert torch.equal(res_out, res_v) and rel_err(res_out, s64) < TOL[dtype]
    if write_h:
        assert close(h, h_v, dtype, ulps=2) and rel_err(h, h64) < TOL[dtype]
    assert all(not (f.any() or c.any()) for f, c in moe_decode_launch._SPLIT_WS.values())


def _cfg(dtype: torch.dtype, block_n: int, warps: int, split: int, pairs: bool, prefetch: bool,
         k_vectors: int = 1) -> dict:
    lane = 16 // torch.empty(0, dtype=dtype).element_size() * 32 * warps
    return {"BLOCK_N": block_n, "BLOCK_K": lane * k_vectors, "SPLIT_K": split, "num_warps": warps,
            "ACC_PAIRS": pairs, "PREFETCH": prefetch}


@pytest.mark.parametrize("M", [1, 2, 3, 6, 9, 16])
def test_token_counts(M: int) -> None:
    """N 11 and K 264 (a partial row block and K tile), the serving config (M <= 3) or one of 8
    rows and 2 splits; with and without a residual (the first layer), bias and h by M; M 9 and
    16 run two token blocks; the GEMV's operand h as vLLM rounds it, or s * w (M 3, 9)."""
    cfg = None if M <= 3 else _cfg(torch.float16, 8, 1, 2, True, True)
    _check(M, 11, 264, torch.float16, residual=M != 2, bias=M % 2 == 1, write_h=M in (1, 3, 9, 16), cfg=cfg,
           exact_h=M not in (3, 9))


FAMILIES = [  # exact_h, dtype, M, N, K, BLOCK_N, num_warps, SPLIT_K, ACC_PAIRS, PREFETCH, vectors per thread
    (True, torch.float16, 4, 12, 512, 4, 1, 2, True, True, 1),     # split K, h from two programs
    (False, torch.float16, 3, 9, 768, 8, 1, 4, False, False, 1),   # 3 tiles over 4 splits: one empty
    (True, torch.float16, 12, 8, 256, 4, 1, 1, False, True, 1),    # two token blocks (8 + 4), no split
    (False, torch.float32, 2, 10, 136, 4, 1, 2, True, True, 1),    # K below one tile
    (True, torch.float32, 7, 6, 256, 2, 2, 1, True, False, 2),     # two vectors per thread along K
]


@pytest.mark.parametrize("case", FAMILIES, ids=lambda c: f"{str(c[1])[6:]}-M{c[2]}-N{c[3]}-K{c[4]}-"
                         f"{'exact' if c[0] else 'folded'}")
def test_config_families(case: tuple) -> None:
    exact_h, dtype, M, N, K, *cfg = case
    _check(M, N, K, dtype, residual=True, bias=M % 2 == 0, write_h=True, cfg=_cfg(dtype, *cfg), exact_h=exact_h)


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    x, r, nw, w, b = _inputs(2, 16, 64, torch.float16, True, True)
    assert ng.unsupported(x, r, nw, w, b) is None
    cases = {
        "tokens": (torch.zeros(ng.MAX_M + 1, 64, dtype=torch.float16), None, nw, w, b),
        "shapes": (x, r[:1], nw, w, b),
        "dtype": (x, r.float(), nw, w, b),
        "weight layout": (x[:, :60].contiguous(), None, nw[:60], w[:, :60], None),
        "x layout": (x, torch.zeros(64, 2, dtype=torch.float16).T, nw, w, None),
        "bias": (x, r, nw, w, b[:8]),
    }
    for why, args in cases.items():
        assert ng.unsupported(*args).startswith(why), (why, ng.unsupported(*args))
        with pytest.raises(ValueError, match=why):
            ng.norm_gemv(args[0], args[1], args[2], EPS, args[3], args[4])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
def test_row_norm_kernel_matches_vllm_past_the_gemv_token_limit(dtype: torch.dtype, residual: bool) -> None:
    """moe_serve.kernels.fused.rms_norm (the ops' norm where the GEMV prologue does not serve), 20 tokens,
    K 1100 (a partial step)."""
    x, r, nw, _, _ = _inputs(20, 1, 1100, dtype, residual, False)
    h, res_out = rms_norm.add_rms_norm(x, r, nw, EPS)
    with vllm_config():
        out = vllm_rms_norm(nw, EPS).forward_native(x.clone(), None if r is None else r.clone())
    h_v = out[0] if residual else out
    assert close(h, h_v, dtype, ulps=2) and rel_err(h, _float64(x, r, nw, nw[None], None)[2]) < TOL[dtype]
    assert (res_out is None) == (not residual) and (res_out is None or torch.equal(res_out, out[1]))


def test_sm90_compiles_without_spills_and_streams_through_registers() -> None:
    """Every fused kernel compiled for sm_90 without a GPU (tests/kernels/_fused_sm90.py, a
    subprocess outside the interpreter): Qwen3-30B-A3B's QKV at its serving configs for M = 1, 2,
    8, 16 (h as vLLM rounds it, and s * w), its gate writing h, fp16 / fp32 with split K, the row
    norm, Q/K norm + RoPE with the cache write. Nothing spills; the norm GEMV's K loop holds no
    shared-memory traffic and exactly one 16-byte load per weight row, per token of x (and of
    the residual) and of the norm weight, one 16-byte store per token of residual_out and of h."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_fused_sm90.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in rows}
    assert len(rows) == 12 and kernels == {"norm_gemv_kernel", "add_rms_norm_kernel", "qk_norm_rope_kernel"}
    assert {r["block_m"] for r in rows if r["block_m"]} == {1, 2, 4, 8}
    assert all(r["narrow_loads"] == 0 for r in rows if r["kernel"] != "qk_norm_rope_kernel"), rows   # no 2-byte loads
    assert {False, True} <= {r["exact_h"] for r in rows}
    for r in rows:
        assert r["spills"] == 0, r
        if r["kernel"] != "norm_gemv_kernel":
            continue
        loop, residual, write_h = r["loop"], "M2" not in r["variant"], "-h" in r["variant"]
        assert not [k for k in loop if k.startswith(("LDS", "STS", "BAR"))], r
        assert loop["LDG.E.128"] == r["block_n"] + r["block_m"] * (1 + residual) + 1, r
        assert loop.get("STG.E.128", 0) == r["block_m"] * (residual + write_h), r
