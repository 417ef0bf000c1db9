"""warm_moe_variants(): visits every reachable bucket and returns the distinct variant count."""
from __future__ import annotations

import torch

from moe_serve.kernels.moe.moe_variants import warm_moe_variants


def test_warmup_counts_the_variants_of_each_path():
    # M=1, 2 slots over 4 experts: the decode path, up + down kernels
    assert warm_moe_variants(4, 16, 32, 2, torch.float32, 1, device="cpu") == 2
    # int64 ids: both decode kernels read the ids, so both get a second variant
    assert warm_moe_variants(4, 16, 32, 2, torch.float32, 1, device="cpu",
                  ids_dtypes=(torch.int32, torch.int64)) == 4
    assert warm_moe_variants(4, 16, 32, 1, torch.float32, 1, device="cpu") == 2
    # up to M=4: buckets 1 and 2 share the decode variants, bucket 4 (8 slots > 4 experts)
    # takes the aligned path: align, gemm1 (+SiLU), gemm2 (+routed weight), top-k sum
    assert warm_moe_variants(4, 16, 32, 2, torch.float32, 4, device="cpu") == 2 + 4


def test_warmup_visits_all_buckets(capsys):
    n = warm_moe_variants(4, 16, 32, 2, torch.float32, 40, device="cpu")
    err = capsys.readouterr().err
    for b in (1, 2, 4, 8, 16, 32, 64):
        assert f"bucket {b} " in err
    assert "bucket 128 " not in err
    assert n > 4
