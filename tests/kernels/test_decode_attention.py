"""Paged decode attention (moe_serve.kernels.attention.decode) under TRITON_INTERPRET=1, fp16 and
fp32, fresh random inputs, NaN-poisoned outputs, pages scattered over a cache whose unused slots
are NaN, against float64 attention over the gathered context: one split and many (the last
program combining the partials), contexts at and around chunk boundaries, a cache in vLLM's
flash layout ([2, blocks, block_size, Hkv, D] halves), and the per-(sequence, head) counters left
at zero for the next call."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.attention import bench_cases
from moe_serve.kernels.attention import decode as dec


def _case(B: int, Hq: int, Hkv: int, D: int, block_size: int, lens: list[int], dtype: torch.dtype, seed: int):
    """q [B, Hq, D], key / value cache halves of one [2, blocks, block_size, Hkv, D] tensor (slots no
    sequence owns are NaN), a block table of shuffled pages, seq_lens."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in lens]
    blocks = sum(pages) + 3
    kv = torch.full((2, blocks, block_size, Hkv, D), float("nan"), dtype=dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    table = torch.zeros(B, max(pages), dtype=torch.int32)
    for b, n in enumerate(lens):
        for p in range(pages[b]):
            page = order.pop()
            table[b, p] = page
            used = min(block_size, n - p * block_size)
            kv[:, page, :used] = torch.randn(2, used, Hkv, D, generator=g).to(dtype)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, kv[0], kv[1], table, torch.tensor(lens, dtype=torch.int32)


def _float64(q, kc, vc, table, lens, scale):
    """float64 attention over the gathered context (the bench case's reference)."""
    return bench_cases.float64_attention(bench_cases.Inputs(q, kc, vc, table, lens, scale))


CASES = [  # B, Hq, Hkv, D, block_size, seq_lens, dtype, num_splits
    (1, 8, 1, 64, 16, [1], torch.float16, None),                 # one token: one split
    (1, 8, 2, 64, 16, [200], torch.float16, None),               # seven active splits of 32
    (2, 4, 4, 32, 8, [33, 64], torch.float32, 4),                # a split past a chunk boundary
    (3, 6, 2, 80, 16, [5, 97, 130], torch.float32, 3),           # D not a power of two, G = 3
    (2, 16, 2, 64, 32, [300, 31], torch.float16, 1),             # one split over a long context
    (1, 4, 1, 64, 16, [1000], torch.float16, 64),                # more splits than tokens per chunk need
]


@pytest.mark.parametrize("B,Hq,Hkv,D,block_size,lens,dtype,splits", CASES)
def test_decode_attention_matches_float64(B, Hq, Hkv, D, block_size, lens, dtype, splits) -> None:
    q, kc, vc, table, seq_lens = _case(B, Hq, Hkv, D, block_size, lens, dtype, seed=B * 100 + sum(lens))
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    got = dec.decode_attention(q, kc, vc, table, seq_lens, scale, out=out, num_splits=splits)
    assert got is out and not out.isnan().any()
    assert rel_err(out, _float64(q, kc, vc, table, seq_lens, scale)) < (2e-3 if dtype == torch.float16 else 1e-5)
    assert not dec._COUNTERS[q.device][-1].any()                   # left at zero for the next launch


@pytest.mark.parametrize("settings", [{"block_n": 16, "min_chunk": 16}, {"block_n": 64, "min_chunk": 128},
                                      {"num_warps": 2, "num_splits": 5},
                                      {"split_tile": 8, "num_splits": 7}, {"split_tile": 4, "num_splits": 11}])
def test_other_tile_and_split_settings_give_the_same_attention(settings: dict) -> None:
    """The settings the GPU benchmark compares (bench_cases.VARIANTS) are all exact."""
    q, kc, vc, table, seq_lens = _case(2, 8, 2, 64, 16, [150, 33], torch.float16, seed=11)
    out = torch.full_like(q, float("nan"))
    dec.decode_attention(q, kc, vc, table, seq_lens, 0.125, out=out, **settings)
    assert rel_err(out, _float64(q, kc, vc, table, seq_lens, 0.125)) < 2e-3


def test_the_same_buffers_serve_a_new_context_length() -> None:
    """As a CUDA graph replays: one launch shape (B, splits), seq_lens rewritten in place between
    calls; each call against float64."""
    q, kc, vc, table, seq_lens = _case(2, 8, 2, 64, 16, [150, 150], torch.float16, seed=7)   # pages for 150 each
    out = torch.full_like(q, float("nan"))
    for lens in ([150, 60], [3, 149], [64, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        dec.decode_attention(q, kc, vc, table, seq_lens, 0.125, out=out, num_splits=8)
        assert rel_err(out, _float64(q, kc, vc, table, seq_lens, 0.125)) < 2e-3, lens


def test_unsupported_layouts_are_named() -> None:
    q, kc, vc, table, seq_lens = _case(1, 4, 2, 32, 16, [20], torch.float16, seed=1)
    with pytest.raises(ValueError, match="no quantized cache"):
        dec.decode_attention(q, kc.float(), vc.float(), table, seq_lens, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        dec.decode_attention(q[:, :3], kc, vc, table, seq_lens, 1.0)
    with pytest.raises(ValueError, match="block_table"):
        dec.decode_attention(q, kc, vc, table.long(), seq_lens, 1.0)
    with pytest.raises(ValueError, match="powers of two"):
        dec.decode_attention(q, kc, vc, table, seq_lens, 1.0, block_n=24)
    with pytest.raises(ValueError, match="split_tile"):
        dec.decode_attention(q, kc, vc, table, seq_lens, 1.0, split_tile=3)
    with pytest.raises(ValueError, match="num_splits"):
        dec.decode_attention(q, kc, vc, table, seq_lens, 1.0, num_splits=dec.MAX_SPLITS + 1)
    assert dec.default_splits(1, 4, torch.device("cpu")) == 4 and dec.default_splits(64, 4, torch.device("cpu")) == 1


def test_sm90_compiles_once_per_model_without_spills() -> None:
    """The kernel compiled for sm_90 without a GPU (tests/kernels/_attention_sm90.py, a subprocess
    outside the interpreter): Qwen3-30B-A3B's heads at B = 1 with 32 splits and at B = 8 with 4
    share one compiled kernel (split count and batch unspecialized: no recompile while serving);
    nothing spills; 16-bit dots run on tensor cores; the combine's atomic is there; the cache is
    read 16 bytes at a time (the strides' alignment is known to the compiler), never 2."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_attention_sm90.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["variant"]: r for r in map(json.loads, (ln for ln in res.stdout.splitlines() if ln.startswith("{")))}
    assert len(rows) == 4 and all(r["spills"] == 0 and r["atomic"] for r in rows.values()), rows
    assert rows["qwen3-bf16-B8"]["compiled"] == 1 and rows["fp32-ieee"]["compiled"] == 3
    assert all(r["mma"] == "HMMA" for name, r in rows.items() if name != "fp32-ieee"), rows
    assert all(r["wide_loads"] > 0 and r["narrow_loads"] == 0 for r in rows.values()), rows
