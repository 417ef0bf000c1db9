"""Config loader and default heuristic."""
from __future__ import annotations

import json

import pytest

from kernels.moe import configs


@pytest.mark.parametrize("shape", [(8, 1792, 4096, 2), (128, 96, 2048, 8), (256, 256, 7168, 8),
                                   (64, 1408, 2048, 6), (2, 16, 32, 1)])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_default_configs_valid(shape, dtype):
    E, N, K, topk = shape
    for M in configs.M_BUCKETS:
        cfg = configs.default_config(M, E, N, K, topk, dtype)
        assert configs.validate(cfg) == cfg
        down = configs.down_config(cfg)
        for c in (cfg, down):
            if c["SWAP_AB"]:
                assert c["BLOCK_M"] < 64 and c["BLOCK_N"] >= 64  # wgmma M slot


def test_bucket_of():
    assert [configs.bucket_of(m) for m in (1, 3, 64, 65, 5000)] == [1, 4, 64, 128, 4096]


def test_table_file_overrides_heuristic(tmp_path, monkeypatch):
    entry = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=5,
                 SWAP_AB=True, DOWN=dict(BLOCK_N=64))
    name = configs.config_file_name(4, 48, 64, "fp16", "testdev")
    (tmp_path / name).write_text(json.dumps({"1": entry, "64": {**entry, "SWAP_AB": False},
                                             "triton_version": "x"}))
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path))
    configs.load_table.cache_clear()
    configs.get_config.cache_clear()
    try:
        c1 = configs.get_config(1, 4, 48, 64, 2, "fp16", "testdev")
        assert c1["num_stages"] == 5 and c1["SWAP_AB"]
        assert configs.down_config(c1)["BLOCK_N"] == 64
        assert configs.down_config(c1)["BLOCK_K"] == 64
        assert not configs.get_config(9, 4, 48, 64, 2, "fp16", "testdev")["SWAP_AB"]
        assert configs.get_config(999, 4, 48, 64, 2, "fp16", "testdev")["BLOCK_M"] == 16
        assert configs.buckets_for(4, 48, 64, "fp16", "testdev") == (1, 64)
    finally:
        configs.load_table.cache_clear()
        configs.get_config.cache_clear()


def test_validate_rejects_bad():
    with pytest.raises(ValueError):
        configs.validate(dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4,
                              num_stages=3, SWAP_AB=False))


def test_a_prequant_is_kept_only_when_set_and_only_on_the_aligned_path():
    from kernels.moe.config_schema import label
    from kernels.tuning.tune import aligned_b

    base = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=4, num_stages=4,
                SWAP_AB=False)
    assert "A_PREQUANT" not in configs.validate({**base, "A_PREQUANT": False})
    pre = configs.validate({**base, "A_PREQUANT": True})
    assert pre["A_PREQUANT"] is True and label(pre).endswith("/q")
    assert not label(configs.validate(base)).endswith("/q")
    with pytest.raises(ValueError, match="A_PREQUANT"):
        configs.validate({**base, "BLOCK_M": 16, "DECODE": True, "A_PREQUANT": True})
    # the tuner's GEMM1 walk offers the flip for fp8 only
    assert any(c.get("A_PREQUANT") for c in aligned_b(configs.validate(base), "fp8"))
    assert not any(c.get("A_PREQUANT") for c in aligned_b(configs.validate(base), "bf16"))


def test_decode_split_fills_the_sms():
    """Split-K (when asked for) brings a decode kernel's programs up to ~one per SM, keeps each
    split's share of the loop, and never splits a kernel that already fills the GPU."""
    from kernels.moe.heuristics import decode_config, decode_split

    assert decode_split(32, 24, 2) == 8            # 32 programs -> 256 ~ two per SM
    assert decode_split(64, 112, 2) == 4           # 64 -> 256
    assert decode_split(32, 12, 2) == 4            # 8 splits would leave < 2 of 12 iterations each
    assert decode_split(100, 64, 2) == 1           # already fills half the SMs
    assert decode_split(1, 1024, 2) == 16          # capped at MAX_SPLIT_K
    plain = decode_config(1, 128, 768, 2048, 8, "bf16")
    split = decode_config(1, 128, 768, 2048, 8, "bf16", split=True)
    assert plain["SPLIT_K"] == plain["DOWN"]["SPLIT_K"] == 1
    assert split["SPLIT_K"] == 1 and split["DOWN"]["SPLIT_K"] == 8   # bf16: only down splits
    assert decode_config(1, 256, 256, 7168, 8, "fp8", split=True)["SPLIT_K"] == 4  # 64 programs
    assert {k: v for k, v in split.items() if k not in ("SPLIT_K", "DOWN")} == \
        {k: v for k, v in plain.items() if k not in ("SPLIT_K", "DOWN")}
