"""bench/bench_moe_block.py on the CPU: its shapes, its PDL switch and its refusal (the checks and
the timing need a GPU)."""
from __future__ import annotations

import pytest
import torch

from bench import bench_moe_block
from kernels.moe import launch as launch_mod
from kernels.moe import router_topk as router_mod
from kernels.moe.launch import record_launches


def test_each_shape_routes_its_own_gate():
    for name, s in bench_moe_block.SHAPES.items():
        assert (s.router.E, s.router.K) == (s.E, s.K), name
        assert 1 <= s.router.topk <= s.E and s.N > 0, name


def test_block_pdl_switch_chains_our_router_whatever_the_env_says(monkeypatch):
    x, w = torch.zeros(1, 64), torch.zeros(8, 64)
    monkeypatch.setattr(launch_mod, "pdl_supported", lambda: True)
    monkeypatch.setenv(launch_mod.BLOCK_PDL_ENV, "1")
    with bench_moe_block.block_pdl(False), record_launches() as off:
        router_mod.router_topk(x, w, 2)
    monkeypatch.setenv(launch_mod.BLOCK_PDL_ENV, "0")
    with bench_moe_block.block_pdl(True), record_launches() as on:
        router_mod.router_topk(x, w, 2)
    assert on[0][3]["USE_PDL"] and on[0][3]["launch_pdl"]
    assert not off[0][3]["USE_PDL"] and "launch_pdl" not in off[0][3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_a_gpu(capsys):
    assert bench_moe_block.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
