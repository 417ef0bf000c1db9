"""Expert load counting (moe_serve.kernels.moe.expert_count, and router_topk's counts) against an integer
reference, on fresh random routing added into random (poisoned) counts, under Triton's interpreter;
the torch path also as torch.compile traces it on vLLM's CPU engine. Under EPLB (physical expert
slots mapped to logical experts) and for ids out of range, against the same reference."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.moe.expert_count import count_experts, count_experts_torch, count_experts_triton, physical_to_logical
from moe_serve.kernels.moe.router_topk import router_topk


def _routing(M: int, E: int, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, topk] distinct experts per token, as a router picks them."""
    return torch.rand(M, E).argsort(-1)[:, :topk].to(dtype)


def _reference(ids: torch.Tensor, E: int, num_tokens: int | None, expert_of: list[int] | None = None
               ) -> tuple[list[int], int]:
    """(counts [E], ids out of range) of the real tokens; expert_of: physical slot -> logical expert."""
    counts, stray = [0] * E, 0
    for m, row in enumerate(ids.tolist()):
        if num_tokens is not None and m >= num_tokens:
            continue
        for e in row:
            if expert_of is not None:
                e = expert_of[e] if 0 <= e < len(expert_of) else -1
            if 0 <= e < E:
                counts[e] += 1
            else:
                stray += 1
    return counts, stray


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
        want = [b + r for b, r in zip(before, _reference(ids, E, num_tokens)[0])]
        assert counts.tolist() == want, (num_tokens, counts.tolist(), want)


@pytest.mark.parametrize("count", [count_experts_triton, count_experts_torch], ids=["triton", "torch"])
def test_ids_outside_the_layer_are_counted_apart(count) -> None:
    E = 8
    ids = torch.tensor([[0, -1], [7, 8], [3, 3], [9, -1]], dtype=torch.int32)     # the last row: padding
    counts, stray = torch.zeros(E, dtype=torch.int64), torch.full((1,), 40, dtype=torch.int64)
    count(ids, counts, torch.tensor([3], dtype=torch.int32), out_of_range=stray)
    assert counts.tolist() == [1, 0, 0, 2, 0, 0, 0, 1] and stray.item() == 42
    count(ids, counts)                                                             # none asked for: skipped
    assert counts.tolist() == [2, 0, 0, 4, 0, 0, 0, 2]


def _placement(E: int, slots: int, replicas: int) -> tuple[torch.Tensor, list[int]]:
    """A random EPLB placement: `slots` physical slots over E logical experts (each at least once),
    as vLLM's logical_to_physical_map [E, replicas] (-1 padded), and the slot -> expert reference."""
    owner = torch.cat([torch.arange(E), torch.randint(0, E, (slots - E,))])[torch.randperm(slots)].tolist()
    placement = torch.full((E, replicas), -1, dtype=torch.int64)
    for slot, e in enumerate(owner):
        free = (placement[e] < 0).nonzero()
        assert free.numel(), "a random placement with more replicas than the map holds; reseed"
        placement[e, free[0, 0]] = slot
    return placement, owner


@pytest.mark.parametrize("count", [count_experts_triton, count_experts_torch], ids=["triton", "torch"])
@pytest.mark.parametrize("M,E,slots,topk", [(1, 8, 10, 2), (37, 16, 20, 4), (600, 64, 72, 6)])
def test_eplb_slots_count_for_their_logical_expert(count, M: int, E: int, slots: int, topk: int) -> None:
    """Physical slots (and ids past them or -1) into poisoned counts; the map rebuilt from the
    placement after a rearrangement counts by the new one."""
    torch.manual_seed(M)
    for _ in range(2):                                           # a placement, then a rearranged one
        placement, owner = _placement(E, slots, replicas=slots - E + 1)
        expert_map = physical_to_logical(placement, slots)
        assert expert_map.tolist() == owner
        ids = torch.randint(-1, slots + 2, (M, topk), dtype=torch.int32)
        ids[0, 0] = slots                                        # past the map: out of range
        for num_tokens in (M, max(1, M // 2)):
            counts = torch.randint(0, 1 << 40, (E,), dtype=torch.int64)
            stray = torch.randint(0, 1 << 40, (1,), dtype=torch.int64)
            before, stray_before = counts.tolist(), stray.item()
            count(ids, counts, torch.tensor([num_tokens], dtype=torch.int32), out_of_range=stray, expert_map=expert_map)
            want, want_stray = _reference(ids, E, num_tokens, owner)
            assert counts.tolist() == [b + w for b, w in zip(before, want)]
            assert stray.item() == stray_before + want_stray and want_stray > 0


def test_a_slot_with_no_logical_expert_maps_to_minus_one() -> None:
    placement = torch.tensor([[2, -1], [0, 3]])                 # slot 1 holds no expert; 4 slots
    assert physical_to_logical(placement, 4).tolist() == [1, -1, 0, 1]


def test_bad_arguments_are_refused() -> None:
    ids = _routing(4, 8, 2, torch.int32)
    with pytest.raises(ValueError, match="int64"):
        count_experts(ids, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[M, topk\]"):
        count_experts(ids.reshape(-1), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_tokens"):
        count_experts(ids, torch.zeros(8, dtype=torch.int64), torch.tensor([4]))
    with pytest.raises(ValueError, match="out_of_range"):
        count_experts(ids, torch.zeros(8, dtype=torch.int64), out_of_range=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert_map"):
        count_experts(ids, torch.zeros(8, dtype=torch.int64), expert_map=torch.zeros(8))


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
        want = [w + r for w, r in zip(want, _reference(ids, E, real)[0])]
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
        want = [b + r for b, r in zip(before, _reference(ids, E, real)[0])]
        assert counts.tolist() == want
    with pytest.raises(ValueError, match="counts"):
        router_topk(x, w, topk, counts=(torch.zeros(E, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)))
