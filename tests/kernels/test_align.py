"""Alignment kernel: every slot once, grouped by expert, padded to BLOCK_M, sentinel = T."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe.align import max_padded_len, moe_align


@pytest.mark.parametrize("M,topk,E,bm", [(1, 1, 2, 16), (1, 8, 256, 16), (7, 8, 64, 16),
                                         (100, 6, 64, 32), (300, 2, 8, 64), (513, 1, 4, 128)])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_align(M, topk, E, bm, ids_dtype):
    g = torch.Generator().manual_seed(M * topk + E)
    ids = torch.randint(0, E, (M, topk), generator=g).to(ids_dtype)
    sorted_ids, expert_ids, num_post = moe_align(ids, E, bm)
    T = M * topk
    n = int(num_post)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert n == int(((counts + bm - 1) // bm * bm).sum())
    assert n <= sorted_ids.numel() == max_padded_len(T, E, bm)
    flat = ids.flatten()
    for b in range(n // bm):
        blk = sorted_ids[b * bm:(b + 1) * bm]
        real = blk[blk < T].long()
        assert ((blk == T) | (blk < T)).all()
        assert (flat[real] == expert_ids[b]).all()
        assert torch.equal(real, real.sort().values)  # stable order inside an expert
    got = sorted_ids[:n]
    assert sorted(got[got < T].tolist()) == list(range(T))
    assert (expert_ids[: n // bm][1:] >= expert_ids[: n // bm][:-1]).all()
