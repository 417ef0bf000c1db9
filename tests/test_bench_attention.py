"""bench/bench_attention.py on CPU: the paged-cache problem and its fp32 reference (the timing
needs a GPU and refuses without one)."""
from __future__ import annotations

import math

import pytest
import torch

from bench.bench_attention import AttentionShape, BLOCK, main, make_problem, reference


def _naive(p, s: AttentionShape, new: int) -> torch.Tensor:
    """Sequence 0's new tokens, attended position by position through the block table after
    writing every new key and value into its slot: [new, H, D]."""
    kc, vc = (c.contiguous().reshape(-1, s.kv_heads, s.head_size) for c in p.caches())
    kc[p.slots], vc[p.slots] = p.k, p.v
    total = int(p.seqlens[0])
    out = torch.empty(new, s.heads, s.head_size, dtype=torch.float64)
    for i in range(new):
        pos = total - new + i
        slot = [int(p.block_table[0, t // BLOCK]) * BLOCK + t % BLOCK for t in range(pos + 1)]
        for h in range(s.heads):
            g = h // (s.heads // s.kv_heads)
            k, v = kc[slot, g].double(), vc[slot, g].double()                 # [pos + 1, D]
            w = torch.softmax(k @ p.q[i, h].double() / math.sqrt(s.head_size), 0)
            out[i, h] = w @ v
    return out


@pytest.mark.parametrize("B,cached,new", [(3, 37, 1), (2, 15, 1), (1, 0, 21), (1, 5, 3)])
def test_reference_attends_through_the_block_table(B: int, cached: int, new: int) -> None:
    s = AttentionShape(heads=4, kv_heads=2, head_size=8)
    p = make_problem(s, B, cached, new, torch.Generator().manual_seed(B + cached + new), dtype=torch.float32)
    assert p.slots.numel() == B * new and len(set(p.slots.tolist())) == B * new
    assert p.cu_q.tolist() == list(range(0, B * new + 1, new))
    torch.testing.assert_close(reference(p, s, new).double(), _naive(p, s, new), rtol=1e-4, atol=1e-5)


def test_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["--m", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
