"""Every shipped bf16 MoE table's decode-bucket configs (M = 1, 2, 4, 8: the tuned corners of the
config space that serving at c <= 8 runs) through fused_moe against the float64 reference, under
TRITON_INTERPRET=1 in fp16, on fresh random inputs into NaN-poisoned outputs. The problem is small
(E = 4, top-2) but keeps each config's K and N tiling meaningful: K covers BLOCK_K x SPLIT_K of
both GEMMs, N at least two of their N tiles."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_serve.bench.experts.reference import moe_reference, rel_err, routing
from moe_serve.kernels.moe import configs
from moe_serve.kernels.moe.fused_moe import fused_moe

SHIPPED = sorted(p for p in configs.CONFIG_DIR.glob("E=*.json") if ",dtype=bf16," in p.name)
BUCKETS = ("1", "2", "4", "8")
E, TOPK, TOL = 4, 2, 3e-3


def _span(cfg: dict, key: str) -> int:
    """How far one GEMM's tiling reaches along `key` (BLOCK_K x SPLIT_K or BLOCK_N)."""
    return cfg[key] * (cfg.get("SPLIT_K", 1) if key == "BLOCK_K" else 1)


def test_tables_ship_for_more_than_one_gpu() -> None:
    assert {p.name.rsplit("device=", 1)[1] for p in SHIPPED} >= {"NVIDIA_H200.json", "NVIDIA_H100_80GB_HBM3.json"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_decode_bucket_configs_match_float64(path: Path) -> None:
    table = json.loads(path.read_text())
    checked = 0
    for bucket in (b for b in BUCKETS if b in table):
        cfg, down = table[bucket], table[bucket].get("DOWN", table[bucket])
        K = max(_span(cfg, "BLOCK_K"), 2 * _span(down, "BLOCK_N"), 64)
        N = max(2 * _span(cfg, "BLOCK_N"), _span(down, "BLOCK_K"), 32)
        M = int(bucket)
        g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
        x = torch.randn(M, K, generator=g).half()
        w1 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).half()
        w2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).half()
        tw, ids = routing(M, E, TOPK, g)
        out = torch.full((M, K), float("nan"), dtype=torch.float16)
        fused_moe(x, w1, w2, tw, ids, out=out, config=cfg)
        err = rel_err(out, moe_reference(x, w1, w2, tw, ids))
        assert err < TOL, (bucket, cfg, err)
        checked += 1
    assert checked, f"{path.name} has none of the buckets {BUCKETS}"
