"""moe_serve.kernels.moe.launch.block_pdl: the switch that chains the MoE block at decode by programmatic
dependent launch, and what the decode path launches with it off (the default) and on."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.config import PluginConfig, configure
from moe_serve.kernels.moe import launch as launch_mod
from moe_serve.kernels.moe import moe_decode_launch
from moe_serve.kernels.moe.fused_moe import fused_moe
from moe_serve.kernels.moe.launch import BLOCK_PDL_ENV, block_pdl, record_launches

E, N, K, TOPK, M = 8, 64, 64, 2, 1
CFG = {"DECODE": True, "PDL": True, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1,
       "num_warps": 4, "num_stages": 2, "SWAP_AB": False,
       "DOWN": {"BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
                "SWAP_AB": False}}


@pytest.fixture
def sm90(monkeypatch):
    """PDL supported, as on a Hopper GPU (the launches are recorded, never run)."""
    monkeypatch.setattr(launch_mod, "pdl_supported", lambda: True)
    monkeypatch.setattr(moe_decode_launch, "pdl_supported", lambda: True)


def decode_launches(config: dict) -> dict[str, dict]:
    x = torch.zeros(M, K, dtype=torch.float16)
    w1, w2 = torch.zeros(E, 2 * N, K, dtype=torch.float16), torch.zeros(E, K, N, dtype=torch.float16)
    tw, ids = torch.ones(M, TOPK), torch.arange(M * TOPK, dtype=torch.int32).reshape(M, TOPK)
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, config=config)
    return {kernel.fn.__name__: kw for kernel, _, _, kw in launches}


@pytest.mark.parametrize("value,want", [(None, False), ("0", False), ("1", True)])
def test_off_unless_the_env_says_1(sm90, monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(BLOCK_PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(BLOCK_PDL_ENV, value)
    assert block_pdl() is want


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_bad_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(BLOCK_PDL_ENV, value)
    with pytest.raises(ValueError, match=BLOCK_PDL_ENV):
        block_pdl()


def test_in_a_worker_the_switch_is_the_configs_built_at_its_start(sm90, monkeypatch):
    """Configured (the plugin at worker init), a launch reads the config's attribute: the
    environment is not parsed again, so a value changed later can neither switch nor break it."""
    configure(PluginConfig(block_pdl=True))
    try:
        monkeypatch.setenv(BLOCK_PDL_ENV, "2")
        assert block_pdl() is True
    finally:
        configure(None)


def test_never_without_pdl_support(monkeypatch):
    monkeypatch.setattr(launch_mod, "pdl_supported", lambda: False)
    monkeypatch.setenv(BLOCK_PDL_ENV, "1")
    assert block_pdl() is False


def test_default_the_down_kernel_alone_is_a_dependent_launch(sm90, monkeypatch):
    monkeypatch.setenv(BLOCK_PDL_ENV, "0")
    k = decode_launches(CFG)
    up, down = k["moe_decode_up_kernel"], k["moe_decode_down_kernel"]
    assert up["USE_PDL"] and not up["PDL_WAIT"] and "launch_pdl" not in up
    assert down["USE_PDL"] and down["launch_pdl"]


def test_chained_the_up_kernel_waits_and_is_a_dependent_launch(sm90, monkeypatch):
    monkeypatch.setenv(BLOCK_PDL_ENV, "1")
    k = decode_launches(CFG)
    up, down = k["moe_decode_up_kernel"], k["moe_decode_down_kernel"]
    assert up["USE_PDL"] and up["PDL_WAIT"] and up["launch_pdl"]
    assert down["USE_PDL"] and down["launch_pdl"]


def test_a_config_without_pdl_launches_plainly_even_chained(sm90, monkeypatch):
    monkeypatch.setenv(BLOCK_PDL_ENV, "1")
    k = decode_launches({**CFG, "PDL": False})
    for kw in k.values():
        assert not kw["USE_PDL"] and "launch_pdl" not in kw
    assert not k["moe_decode_up_kernel"]["PDL_WAIT"]
