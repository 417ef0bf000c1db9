"""warm_moe_variants(): visits every reachable bucket and returns the distinct variant count."""
from __future__ import annotations

import torch

from kernels.moe_variants import warm_moe_variants


def test_warmup_single_bucket_is_four_variants():
    # align, gemm1 (+SiLU), gemm2 (+routed weight), top-k sum
    assert warm_moe_variants(4, 16, 32, 2, torch.float32, 1, device="cpu") == 4
    # int64 ids add one align variant; topk == 1 drops the top-k sum
    assert warm_moe_variants(4, 16, 32, 2, torch.float32, 1, device="cpu",
                  ids_dtypes=(torch.int32, torch.int64)) == 5
    assert warm_moe_variants(4, 16, 32, 1, torch.float32, 1, device="cpu") == 3


def test_warmup_visits_all_buckets(capsys):
    n = warm_moe_variants(4, 16, 32, 2, torch.float32, 40, device="cpu")
    err = capsys.readouterr().err
    for b in (1, 2, 4, 8, 16, 32, 64):
        assert f"bucket {b} " in err
    assert "bucket 128 " not in err
    assert n > 4
