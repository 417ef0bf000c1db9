"""The decode path's L2 prefetch of the down weights (config key PREFETCH): the schema, when the
launcher passes it on, and that it compiles for sm_90 into one bulk prefetch placed where its mode
says (the refine phase that tunes it: tests/kernels/test_tune_phases.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.kernels.moe import moe_decode_launch
from moe_serve.kernels.moe.config_schema import label, validate
from moe_serve.kernels.moe.fused_moe import fused_moe
from moe_serve.kernels.moe.launch import record_launches

TOPK = 2
DECODE = {"DECODE": True, "PDL": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
          "num_warps": 4, "num_stages": 4, "SWAP_AB": True,
          "DOWN": {"BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 4,
                   "SWAP_AB": True, "SPLIT_K": 4}}


def test_schema_keeps_a_mode_only_where_set_and_refuses_bad_ones() -> None:
    assert "PREFETCH" not in validate({**DECODE, "PREFETCH": 0})
    assert validate({**DECODE, "PREFETCH": 2})["PREFETCH"] == 2
    assert label(validate({**DECODE, "PREFETCH": 1})).endswith("/pf1")
    assert "/pf" not in label(validate(DECODE))
    with pytest.raises(ValueError, match="PREFETCH"):
        validate({**DECODE, "PREFETCH": 3})
    aligned = {k: v for k, v in DECODE.items() if k not in ("DECODE", "PDL")}
    with pytest.raises(ValueError, match="PREFETCH"):
        validate({**aligned, "PREFETCH": 1})


def _up_kwargs(w2: torch.Tensor, mode: int) -> dict:
    e, n, k = w2.shape[0], w2.shape[2], w2.shape[1]
    x, w1 = torch.zeros(1, k, dtype=torch.float16), torch.zeros(e, 2 * n, k, dtype=torch.float16)
    ids = torch.arange(TOPK, dtype=torch.int32).reshape(1, TOPK)
    with record_launches() as launches:
        fused_moe(x, w1, w2, torch.ones(1, TOPK), ids, config={**DECODE, "PREFETCH": mode})
    return next(kw for kern, _, _, kw in launches if kern.fn.__name__ == "moe_decode_up_kernel")


def test_launcher_passes_the_mode_on_sm90_with_a_contiguous_w2(monkeypatch) -> None:
    w2 = torch.zeros(4, 128, 64, dtype=torch.float16)                     # [E, K, N]
    assert _up_kwargs(w2, 1)["PREFETCH"] == 0          # the interpreter: no inline PTX
    monkeypatch.setattr(moe_decode_launch, "pdl_supported", lambda: True)
    kw = _up_kwargs(w2, 1)
    assert kw["PREFETCH"] == 1 and kw["PF_SLOTS"] == 32 * DECODE["num_warps"]
    assert _up_kwargs(w2, 2)["PREFETCH"] == 2
    strided = torch.zeros(4, 64, 128, dtype=torch.float16).transpose(1, 2)   # not contiguous
    assert _up_kwargs(strided, 1)["PREFETCH"] == 0


def test_compiles_for_sm90_into_one_bulk_prefetch_where_the_mode_puts_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_prefetch_sm90.py"))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {(r["format"], r["mode"]): r for r in map(json.loads, res.stdout.splitlines())}
    assert len(rows) == 6 and all(r["mma"] and r["kw"] == r["mode"] for r in rows.values())
    for fmt in ("bf16", "block"):
        assert rows[(fmt, 0)]["prefetches"] == 0
        assert rows[(fmt, 1)]["prefetches"] == 1 and rows[(fmt, 1)]["before_mma"]
        assert rows[(fmt, 2)]["prefetches"] == 1 and not rows[(fmt, 2)]["before_mma"]
