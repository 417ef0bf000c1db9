"""bench/bench_router.py on the CPU: its agreement check and its refusals (the timing needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from bench import bench_router


def _pair(ids: list[list[int]], w: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(w), torch.tensor(ids, dtype=torch.int32)


def test_check_allows_other_sets_only_at_a_near_tie():
    shape = bench_router.RouterShape(E=4, K=8, topk=1)
    ours = _pair([[2], [0]], [[1.0], [1.0]])
    theirs = _pair([[2], [1]], [[1.0], [1.0]])
    tie = torch.tensor([[0.0, 0.1, 3.0, 0.2], [1.0, 0.99, -1.0, -2.0]])   # row 1: experts 0 and 1 tie
    got = bench_router.check(shape, ours, theirs, tie)
    assert got == {"rows_differing_at_near_ties": 1, "max_weight_diff": 0.0}
    apart = torch.tensor([[0.0, 0.1, 3.0, 0.2], [1.0, 0.5, -1.0, -2.0]])
    with pytest.raises(AssertionError, match="near-tie"):
        bench_router.check(shape, ours, theirs, apart)


def test_check_reports_the_weight_difference_in_slot_order_of_either():
    shape = bench_router.RouterShape(E=4, K=8, topk=2)
    ours = _pair([[3, 1]], [[0.7, 0.3]])
    theirs = _pair([[1, 3]], [[0.25, 0.75]])
    got = bench_router.check(shape, ours, theirs, torch.tensor([[0.0, 1.0, -1.0, 2.0]]))
    assert got["rows_differing_at_near_ties"] == 0 and got["max_weight_diff"] == pytest.approx(0.05)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_a_gpu(capsys):
    assert bench_router.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_check_measures_sigmoid_ties_on_score_plus_bias():
    shape = bench_router.RouterShape(E=3, K=8, topk=1, scoring="sigmoid", bias=True)
    logits = torch.tensor([[0.0, 2.0, -3.0]])
    bias = torch.tensor([0.5, 0.0, 0.0])                   # keys 1.0, 0.881, 0.047: no tie
    ours, theirs = _pair([[1]], [[0.9]]), _pair([[0]], [[0.5]])
    with pytest.raises(AssertionError, match="near-tie"):
        bench_router.check(shape, ours, theirs, logits, bias)
    bias = torch.tensor([0.385, 0.0, 0.0])                 # keys 0.885, 0.881: a near-tie
    assert bench_router.check(shape, ours, theirs, logits, bias)["rows_differing_at_near_ties"] == 1
