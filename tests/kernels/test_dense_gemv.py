"""The dense decode GEMV (moe_serve.kernels.dense.gemv) against a float64 reference under TRITON_INTERPRET=1:
every token count 1..8, every config family (accumulator pairs or reduced, with and without the
register prefetch, plain and split K), shapes not divisible by the blocks, with and without bias,
fresh random inputs written into NaN-poisoned outputs. fp16 and fp32; bf16 too, whose path loads
int32 words and widens them with integer ops (the interpreter's broken bf16 is its tl.dot, which
this kernel does not use)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.dense import configs
from moe_serve.kernels.dense.gemv import dense_gemv, unsupported
from moe_serve.kernels.moe import moe_decode_launch
from tests.kernels.test_dense_gemv_fp8 import _check as check_fp8

TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _inputs(M: int, N: int, K: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)     # fresh inputs every run
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _cfg(dtype: torch.dtype, block_n: int, warps: int, split: int, pairs: bool, prefetch: bool,
         k_vectors: int = 1) -> dict:
    lane = 16 // torch.empty(0, dtype=dtype).element_size() * 32 * warps
    return {"BLOCK_N": block_n, "BLOCK_K": lane * k_vectors, "SPLIT_K": split, "num_warps": warps,
            "ACC_PAIRS": pairs, "PREFETCH": prefetch}


def _check(M: int, N: int, K: int, dtype: torch.dtype, bias: bool, cfg: dict | None) -> None:
    x, w, b = _inputs(M, N, K, dtype, bias)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    assert dense_gemv(x, w, b, cfg=cfg, out=out) is out
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]
    worst = ((out.double() - ref).abs() / (ref.abs() + ref.abs().mean())).max().item()
    assert worst < 4 * TOL[dtype], worst
    assert all(not (f.any() or c.any()) for f, c in moe_decode_launch._SPLIT_WS.values())


@pytest.mark.parametrize("M", range(1, 9))
def test_every_token_count_with_the_default_config(M: int) -> None:
    """N 37 and K 264: a partial row block and a partial K tile (K = 264 is one 256-wide tile and
    8 more columns); bias on odd M."""
    _check(M, 37, 264, torch.float16, M % 2 == 1, None)


FAMILIES = [  # dtype, M, N, K, BLOCK_N, num_warps, SPLIT_K, ACC_PAIRS, PREFETCH, vectors per thread
    (torch.float16, 1, 24, 512, 8, 1, 1, True, True, 1),      # several K tiles, one program per 8 rows
    (torch.float16, 8, 19, 264, 2, 1, 2, False, True, 1),     # split K over a partial last tile
    (torch.float16, 5, 33, 768, 4, 1, 4, True, False, 1),     # 3 tiles over 4 splits: one empty
    (torch.float16, 3, 16, 1024, 1, 2, 1, False, False, 2),   # two vectors per thread along K
    (torch.float32, 2, 21, 384, 4, 1, 2, True, True, 1),
    (torch.float32, 7, 40, 120, 8, 1, 1, False, True, 1),     # K below one tile
    (torch.float32, 4, 9, 512, 16, 2, 4, False, False, 1),    # more rows per block than N
    (torch.bfloat16, 1, 30, 520, 4, 1, 2, True, True, 1),
    (torch.bfloat16, 6, 17, 256, 2, 1, 1, False, False, 1),
    (torch.bfloat16, 8, 12, 1024, 4, 2, 2, True, True, 1),
]


@pytest.mark.parametrize("case", FAMILIES, ids=lambda c: f"{NAMES[c[0]]}-M{c[1]}-N{c[2]}-K{c[3]}-"
                         f"{configs.label(_cfg(c[0], *c[4:]))}")
@pytest.mark.parametrize("bias", [False, True])
def test_config_families(case: tuple, bias: bool) -> None:
    dtype, M, N, K, *cfg = case
    _check(M, N, K, dtype, bias, _cfg(dtype, *cfg))


def test_calls_repeat_exactly_through_the_self_clearing_workspace() -> None:
    x, w, b = _inputs(4, 20, 512, torch.float32, True)
    cfg = _cfg(torch.float32, 4, 1, 4, True, True)
    first = dense_gemv(x, w, b, cfg=cfg)
    assert torch.equal(first, dense_gemv(x, w, b, cfg=cfg))


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    x, w, b = _inputs(2, 16, 64, torch.float16, True)
    assert unsupported(x, w, b) is None
    cases = {
        "tokens": (torch.zeros(9, 64, dtype=torch.float16), w, b),
        "shapes": (x, w[:, :32], None),
        "dtype": (x.float(), w, b),
        "weight layout": (x[:, :60].contiguous(), w[:, :60], None),   # K not a multiple of 8
        "x layout": (torch.zeros(64, 2, dtype=torch.float16).T, w, None),
        "bias": (x, w, b[:8]),
    }
    for why, args in cases.items():
        assert unsupported(*args).startswith(why), (why, unsupported(*args))
        with pytest.raises(ValueError, match=why):
            dense_gemv(*args)
    with pytest.raises(ValueError, match="out"):
        dense_gemv(x, w, b, out=torch.empty(2, 15, dtype=torch.float16))
    with pytest.raises(ValueError, match="BLOCK_K"):
        dense_gemv(x, w, b, cfg={**_cfg(torch.float16, 4, 2, 1, True, True), "BLOCK_K": 256})


def test_sm90_k_loop_streams_16_byte_vectors_through_registers() -> None:
    """Compiled for sm_90 without a GPU (tests/kernels/_dense_sm90.py, a subprocess outside the
    interpreter): the default config of three real bf16 shapes at M = 1..8, and one of
    each other family. The K loop holds no shared-memory traffic (no layout conversion), exactly
    one 16-byte load per weight row and per token in each thread and no narrower load, one FFMA
    per product with the accumulator pairs (half of them FMAs without), and nothing spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_dense_sm90.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 27 and {r["block_m"] for r in rows} == {1, 2, 4, 8}
    assert {r["split"] for r in rows} > {1} and {r["pairs"] for r in rows} == {True, False}
    for r in rows:
        loop = r["loop"]
        assert r["spills"] == 0, r
        assert not [k for k in loop if k.startswith(("LDS", "STS", "BAR"))], r
        assert [k for k in loop if k.startswith("LDG")] == ["LDG.E.128"], r
        assert loop["LDG.E.128"] == r["block_n"] + r["block_m"], r
        products = r["block_m"] * r["block_n"] * r["vec"]
        assert loop["FFMA"] == (products if r["pairs"] else products // 2), r


SHIPPED = sorted(configs.SHIPPED_DIR.glob("dense,*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_table_config_on_its_k_and_bucket(path: Path) -> None:
    """Each tuned bucket's config as shipped, on the table's K and dtype at the bucket's M (and
    M - 1 tokens where that is in the bucket), over a few row blocks (a partial one included);
    an FP8 table's on weights of its format with fp16 activations."""
    fields = dict(part.split("=", 1) for part in path.stem.split(",")[1:])
    K, dt = int(fields["K"]), fields["dtype"]
    raw = json.loads(path.read_text())          # read whole: load_table refuses another Triton's
    assert raw["triton_version"] and path.name == configs.table_file_name(int(fields["N"]), K, dt, fields["device"])
    table = {int(k): configs.validate(v, dt) for k, v in raw.items() if k.isdigit()}
    assert table and set(table) <= set(configs.BUCKETS), path
    for bm, cfg in table.items():
        for M in sorted({bm, max(1, bm // 2 + 1)}):
            if configs.is_fp8(dt):
                check_fp8(M, 2 * cfg["BLOCK_N"] + 1, K, dt, torch.float16, M % 2 == 1, cfg)
            else:
                _check(M, 2 * cfg["BLOCK_N"] + 1, K, {v: k for k, v in NAMES.items()}[dt], M % 2 == 1, cfg)
