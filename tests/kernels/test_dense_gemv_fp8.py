"""The FP8 dense decode GEMV (moe_serve.kernels.dense.gemv_fp8) under TRITON_INTERPRET=1, on fresh random
inputs into NaN-poisoned outputs: every token count 1..16 at the default config, each scale
format (per tensor, per channel [N, 1], block [128, 128] and smaller blocks, partial blocks at
odd N and K not a multiple of 128), fp16 / fp32 / bf16 activations, the config families (split K,
no prefetch, reduced accumulators, block scales on x or on w); against float64 of the dequantized
weights, and against vLLM's own FP8 semantics: vLLM's batch-invariant dequantization
x @ (Wq.float() * scale).T for per tensor / per channel, and vLLM's block dequantization
(quant_utils.scaled_dequantize, whole blocks) for block scales. The op's CPU fallback (F.linear on
the dequantized weights) and its weight views as vLLM stores them are checked too."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.bench.experts.dense_fp8 import BLOCK, CHANNEL, TENSOR, quantize
from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.dense import configs, op_fp8
from moe_serve.kernels.dense.gemv_fp8 import FP8, dense_gemv_fp8, unsupported
from moe_serve.kernels.moe import moe_decode_launch

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2 ** 31)     # fresh inputs every run


def _case(M: int, N: int, K: int, fmt: str, dtype: torch.dtype, bias: bool, g: torch.Generator):
    q, scale, deq = quantize(torch.randn(N, K, generator=g) / K ** 0.5, fmt)
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, q, scale, deq, b


def _check(M: int, N: int, K: int, fmt: str, dtype: torch.dtype, bias: bool, cfg: dict | None) -> torch.Tensor:
    g = _gen()
    x, q, scale, deq, b = _case(M, N, K, fmt, dtype, bias, g)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    assert dense_gemv_fp8(x, q, scale, b, configs.block_of(fmt), cfg=cfg, out=out) is out
    ref = x.double() @ deq.T + (b.double() if b is not None else 0.0)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]
    worst = ((out.double() - ref).abs() / (ref.abs() + ref.abs().mean())).max().item()
    assert worst < 4 * TOL[dtype], worst
    assert all(not (f.any() or c.any()) for f, c in moe_decode_launch._SPLIT_WS.values())
    return out


FORMATS = (TENSOR, CHANNEL, BLOCK, configs.fp8_key((16, 64)))


@pytest.mark.parametrize("M", range(1, 17))
def test_every_token_count_with_the_default_config(M: int) -> None:
    """N 9 (a partial row block, and of the scale blocks) and K 272 (17 vectors: a partial K tile,
    a partial 128-column group); the formats in turn, bias on odd M, fp16 (fp32 every fourth M)."""
    _check(M, 9, 272, FORMATS[M % 4], torch.float32 if M % 4 == 3 else torch.float16, M % 2 == 1, None)


def _cfg(block_n: int, warps: int, split: int, pairs: bool, prefetch: bool, k_vectors: int = 1) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": 16 * 32 * warps * k_vectors, "SPLIT_K": split, "num_warps": warps,
            "ACC_PAIRS": pairs, "PREFETCH": prefetch}


FAMILIES = [  # M, N, K, format, x dtype, (BLOCK_N, num_warps, SPLIT_K, ACC_PAIRS, PREFETCH, vectors)
    (1, 24, 1536, BLOCK, torch.float16, (8, 1, 1, True, True)),           # 3 tiles, block scales on x
    (12, 11, 1040, configs.fp8_key((16, 128)), torch.float16, (4, 1, 2, False, True)),   # scales on w, split
    (5, 7, 1536, CHANNEL, torch.bfloat16, (2, 1, 4, True, False)),        # 3 tiles over 4 splits
    (3, 16, 2048, TENSOR, torch.bfloat16, (1, 2, 1, False, False, 2)),    # two vectors per thread
    (16, 9, 512, configs.fp8_key((8, 32)), torch.float32, (1, 1, 1, True, True)),   # 16 groups per tile
]


@pytest.mark.parametrize("case", FAMILIES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-{c[3]}-"
                         f"{str(c[4])[6:]}-{configs.label(_cfg(*c[5]))}")
def test_config_families(case: tuple) -> None:
    M, N, K, fmt, dtype, cfg = case
    _check(M, N, K, fmt, dtype, M % 2 == 0, _cfg(*cfg))


def test_vllms_dequantization_semantics() -> None:
    """Ours against vLLM's own dequantized weights, float64 product: per tensor / per channel as
    its batch-invariant FP8 path dequantizes (Wq.float() * scale), block by its scaled_dequantize
    (it takes whole blocks: N, K multiples of 128)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_dequantize

    g = _gen()
    for fmt, (N, K) in ((TENSOR, (40, 256)), (CHANNEL, (40, 256)), (BLOCK, (128, 256))):
        x, q, scale, _, _ = _case(3, N, K, fmt, torch.float16, False, g)
        if fmt == BLOCK:
            theirs = scaled_dequantize(q, scale, group_shape=GroupShape(128, 128))
        else:
            theirs = q.float() * scale.reshape(-1, 1)
        out = torch.full((3, N), float("nan"), dtype=torch.float16)
        dense_gemv_fp8(x, q, scale, None, configs.block_of(fmt), out=out)
        assert rel_err(out, x.double() @ theirs.double().T) < TOL[torch.float16], fmt


def test_the_op_takes_vllms_stored_layouts_and_falls_back_to_dequantized_f_linear(monkeypatch) -> None:
    """The op on the transposed [K', N'] view (vLLM's CUTLASS layout, N and K padded to 16, the
    per-channel scale padded with 1.0) and on [N, K] block weights: our kernel at M <= 16 (under
    the interpreter), F.linear of the dequantized weights at M = 17 and on CPU without it."""
    monkeypatch.setattr(op_fp8, "CPU_INTERPRETER", True)
    monkeypatch.setattr(op_fp8, "UNTUNED_TOO", True)
    g = _gen()
    N, K = 21, 272
    for fmt in (CHANNEL, BLOCK):
        _, q, scale, deq, b = _case(1, N, K, fmt, torch.float16, True, g)
        if fmt == CHANNEL:        # CUTLASS's padded column-major B and padded scale
            stored = torch.zeros(32, K + 16, dtype=FP8)
            stored[:N, :K] = q
            stored, scale = stored.t(), torch.cat([scale, torch.ones(11, 1)])
        else:
            stored = q
        for M in (2, 17):
            x = torch.randn(M, K, generator=g).half()
            y = op_fp8.fp8_dense_linear(x, stored, scale, b, N, fmt == CHANNEL, configs.block_of(fmt))
            assert y.shape == (M, N) and y.dtype == torch.float16
            assert rel_err(y, x.double() @ deq.T + b.double()) < TOL[torch.float16], (fmt, M)
    assert {k[2] for k in op_fp8.seen()} >= {CHANNEL, BLOCK}


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    g = _gen()
    x, q, scale, _, b = _case(2, 16, 64, CHANNEL, torch.float16, True, g)
    assert unsupported(x, q, scale, b) is None
    cases = {
        "tokens": (torch.zeros(17, 64, dtype=torch.float16), q, scale, b, None),
        "shapes": (x, q[:, :32], scale, None, None),
        "dtype": (x, q.half(), scale, b, None),
        "weight layout": (x[:, :40].contiguous(), q[:, :40], scale, None, None),   # K not a multiple of 16
        "x layout": (torch.zeros(64, 2, dtype=torch.float16).T, q, scale, None, None),
        "scale dtype": (x, q, scale.half(), None, None),
        "scale (": (x, q, scale[:8], None, None),
        "block (16, 8)": (x, q, torch.ones(1, 8), None, (16, 8)),                    # a vector spans groups
        "block scale": (x, q, torch.ones(1, 1), None, (16, 32)),                      # does not cover K
        "bias": (x, q, scale, b.float(), None),
    }
    for why, args in cases.items():
        assert unsupported(*args).startswith(why), (why, unsupported(*args))
        with pytest.raises(ValueError, match=re.escape(why)):
            dense_gemv_fp8(*args[:4], args[4])
    with pytest.raises(ValueError, match="BLOCK_N"):             # rows across two scale blocks
        dense_gemv_fp8(x, q, torch.ones(2, 2), None, (8, 32), cfg=_cfg(16, 1, 1, True, True))


def test_sm90_default_configs_stream_16_byte_vectors_without_spills() -> None:
    """Compiled for sm_90 without a GPU (tests/kernels/_dense_sm90.py fp8, a subprocess outside the
    interpreter): the default configs of Qwen3-30B's block-FP8 QKV at each bucket (bf16 x) and a
    per-channel O (fp16 x). Nothing spills; the K loop holds no shared-memory traffic (x's half
    vectors land in the threads that hold their weights), one 16-byte load per weight row and two
    per token (the x half vectors), fp8 pairs converted by F2FP (8 per row and vector), one FFMA
    per product, and block scales multiplied 16 x min(BLOCK_M, BLOCK_N) times per vector."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_dense_sm90.py")), "fp8"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6 and {r["block_m"] for r in rows} == {1, 2, 4, 8, 16}
    for r in rows:
        loop, bm, bn = r["loop"], r["block_m"], r["block_n"]
        assert r["spills"] == 0, r
        assert not [k for k in loop if k.startswith(("LDS", "STS", "BAR", "LDL", "STL"))], r
        assert loop["LDG.E.128"] == bn + 2 * bm, r
        assert loop["F2FP.F16.E4M3.UNPACK_B"] == 8 * bn and loop["FFMA"] == 16 * bm * bn, r
        assert loop.get("LDG.E", 0) == (r["scale"] == 3) and loop.get("FMUL", 0) == (16 * min(bm, bn) if r["scale"] == 3 else 0), r
