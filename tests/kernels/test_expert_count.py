"""Expert load counting (kernels.moe.expert_count, and router_topk's counts) against an integer
reference, on fresh random routing added into random (poisoned) counts, under Triton's interpreter;
the torch path also as torch.compile traces it on vLLM's CPU engine."""
from __future__ import annotations

import pytest
import torch

from kernels.moe.expert_count import count_experts, count_experts_torch, count_experts_triton
from kernels.moe.router_topk import router_topk


def _routing(M: int, E: int, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, topk] distinct experts per token, as a router picks them."""
    return torch.rand(M, E).argsort(-1)[:, :topk].to(dtype)


def _reference(ids: torch.Tensor, E: int, num_tokens: int | None) -> list[int]:
    counts = [0] * E
    for m, row in enumerate(ids.tolist()):
        if num_tokens is not None and m >= num_tokens:
            continue
        for e in row:
            if 0 <= e < E:
                counts[e] += 1
    return counts


@pytest.mark.parametrize("count", [count_experts_triton, count_experts_torch], ids=["triton", "torch"])
@pytest.mark.parametrize("M,E,topk", [(1, 8, 2), (7, 128, 8), (300, 64, 6), (1100, 16, 1)])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_counts_add_each_real_tokens_experts(count, M: int, E: int, topk: int, ids_dtype: torch.dtype) -> None:
    ids = _routing(M, E, topk, ids_dtype)
    for num_tokens in (None, M, max(0, M - 3), 0):
        counts = torch.randint(0, 1 << 40, (E,), dtype=torch.int64)   # what earlier calls left
        before = counts.tolist()
        n = None if num_tokens is None else torch.tensor([num_tokens], dtype=torch.int32)
        count(ids, counts, n)
        want = [b + r for b, r in zip(before, _reference(ids, E, num_tokens))]
        assert counts.tolist() == want, (num_tokens, counts.tolist(), want)


@pytest.mark.parametrize("count", [count_experts_triton, count_experts_torch], ids=["triton", "torch"])
def test_ids_outside_the_layer_are_skipped(count) -> None:
    E = 8
    ids = torch.tensor([[0, -1], [7, 8], [3, 3]], dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int64)
    count(ids, counts)
    assert counts.tolist() == [1, 0, 0, 2, 0, 0, 0, 1]


def test_bad_arguments_are_refused() -> None:
    ids = _routing(4, 8, 2, torch.int32)
    with pytest.raises(ValueError, match="int64"):
        count_experts(ids, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[M, topk\]"):
        count_experts(ids.reshape(-1), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_tokens"):
        count_experts(ids, torch.zeros(8, dtype=torch.int64), torch.tensor([4]))


def test_traced_by_torch_compile_it_adds_in_place() -> None:
    """As on vLLM's CPU engine: the counts row and num_tokens are attributes of an object the
    traced code reaches (vLLM's router), mutated in place by the compiled graph at every call."""
    class Router:
        pass

    E, topk = 16, 4
    router = Router()
    router.load = torch.zeros(3, E, dtype=torch.int64)                # [L, E]: the row is this layer's
    router.num_tokens = torch.zeros(1, dtype=torch.int32)

    @torch.compile(fullgraph=True, dynamic=True)
    def select(logits: torch.Tensor) -> torch.Tensor:
        ids = logits.topk(topk, -1).indices.to(torch.int32)
        count_experts_torch(ids, router.load[1], router.num_tokens)
        return ids

    want = [0] * E
    for M, real in ((5, 5), (9, 6), (1, 1)):
        router.num_tokens.fill_(real)
        ids = select(torch.randn(M, E))
        want = [w + r for w, r in zip(want, _reference(ids, E, real))]
    assert router.load[1].tolist() == want
    assert not router.load[0].any() and not router.load[2].any()


@pytest.mark.parametrize("M,E,K,topk", [(1, 8, 256, 2), (3, 128, 1024, 8), (5, 60, 96, 4)])
def test_router_counts_the_experts_it_picks(M: int, E: int, K: int, topk: int) -> None:
    """router_topk with counts (both its one-program and split paths) adds exactly the experts it
    returns for the first num_tokens tokens."""
    x = torch.randn(M, K, dtype=torch.float16)
    w = (torch.randn(E, K) / K ** 0.5).to(torch.float16)
    for real in (M, M - 1):
        counts = torch.randint(0, 1 << 40, (E,), dtype=torch.int64)
        before = counts.tolist()
        _, ids = router_topk(x, w, topk, counts=(counts, torch.tensor([real], dtype=torch.int32)))
        want = [b + r for b, r in zip(before, _reference(ids, E, real))]
        assert counts.tolist() == want
    with pytest.raises(ValueError, match="counts"):
        router_topk(x, w, topk, counts=(torch.zeros(E, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)))
