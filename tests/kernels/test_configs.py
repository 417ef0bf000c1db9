"""Config loader and default heuristic."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.kernels.moe import configs, selection


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


ENTRY = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=5,
             SWAP_AB=True, DOWN=dict(BLOCK_N=64))


def _write_table(d: Path, triton_version: str | None, E: int = 4, **extra) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / configs.config_file_name(E, 48, 64, "fp16", "testdev")
    data = {"1": ENTRY, "64": {**ENTRY, "SWAP_AB": False}, **extra}
    if triton_version is not None:
        data["triton_version"] = triton_version
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def config_dirs(tmp_path, monkeypatch):
    """(env dir, tuner cache dir) in tmp_path, caches cleared before and after."""
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path / "cache"))
    selection.clear_caches()
    yield tmp_path / "env", configs.cache_dir("testdev")
    selection.clear_caches()


def test_table_file_overrides_heuristic(config_dirs):
    _write_table(config_dirs[0], configs.running_triton_version())
    c1 = selection.get_config(1, 4, 48, 64, 2, "fp16", "testdev")
    assert c1["num_stages"] == 5 and c1["SWAP_AB"]
    assert configs.down_config(c1)["BLOCK_N"] == 64
    assert configs.down_config(c1)["BLOCK_K"] == 64
    assert not selection.get_config(9, 4, 48, 64, 2, "fp16", "testdev")["SWAP_AB"]
    assert selection.get_config(999, 4, 48, 64, 2, "fp16", "testdev")["BLOCK_M"] == 16
    assert selection.buckets_for(4, 48, 64, "fp16", "testdev") == (1, 64)
    assert configs.find_table(4, 48, 64, "fp16", "testdev").source == configs.ENV_DIR


def test_table_of_another_triton_is_refused_and_the_search_goes_on(config_dirs, caplog):
    """A table recording another Triton version is refused with a warning naming `moe-serve
    tune`; the next dir's table serves; with none left, the default rule does."""
    env, cache = config_dirs
    stale = _write_table(env, "0.0.1-other")
    _write_table(cache, configs.running_triton_version())
    with caplog.at_level("WARNING"):
        found = configs.find_table(4, 48, 64, "fp16", "testdev")
    assert found.source == configs.TUNER_CACHE and found.table is not None
    assert len(found.refused) == 1 and str(stale) in found.refused[0] and "0.0.1-other" in found.refused[0]
    assert "moe-serve tune" in caplog.text and str(stale) in caplog.text
    (cache / stale.name).unlink()
    selection.clear_caches()
    alone = configs.find_table(4, 48, 64, "fp16", "testdev")
    assert alone.table is None and alone.refused
    choice = selection.config_choice(1, 4, 48, 64, 2, "fp16", "testdev")
    assert choice.source == selection.DEFAULT_RULE and choice.refused == alone.refused
    # the same file is taken when the configs will run under the Triton it records
    assert configs.find_table(4, 48, 64, "fp16", "testdev", "0.0.1-other").source == configs.ENV_DIR


def test_table_without_a_triton_version_is_taken(config_dirs):
    _write_table(config_dirs[0], None)
    found = configs.find_table(4, 48, 64, "fp16", "testdev")
    assert found.table is not None and found.refused == ()


def test_validate_rejects_bad():
    with pytest.raises(ValueError):
        configs.validate(dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4,
                              num_stages=3, SWAP_AB=False))


def test_a_prequant_defaults_per_path_and_is_kept_only_where_it_differs():
    """Quantize-once is the aligned path's default, in-loop the decode path's; a config keeps
    the key (and its label a mark) only when it departs from its path's default, so the shipped
    tables' aligned configs now quantize once."""
    from moe_serve.kernels.moe.config_schema import label, prequant
    from moe_serve.kernels.tuning.candidates import aligned_b
    from moe_serve.kernels.tuning.tune import PHASES

    base = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=4, num_stages=4,
                SWAP_AB=False)
    dec = {**base, "BLOCK_M": 16, "DECODE": True}
    assert prequant(configs.validate(base)) and not prequant(configs.validate(dec))
    assert "A_PREQUANT" not in configs.validate({**base, "A_PREQUANT": True})
    assert "A_PREQUANT" not in configs.validate({**dec, "A_PREQUANT": False})
    inloop = configs.validate({**base, "A_PREQUANT": False})
    assert inloop["A_PREQUANT"] is False and not prequant(inloop) and label(inloop).endswith("/iq")
    pre_dec = configs.validate({**dec, "A_PREQUANT": True})
    assert prequant(pre_dec) and label(pre_dec).endswith("/q")
    assert not label(configs.validate(base)).endswith("q")
    # the tuner's walks offer the flip for fp8 formats only, on both paths
    for fmt, want in (("fp8", True), ("fp8_w8a8,block_shape=[128,128]", True), ("bf16", False)):
        assert any(not prequant(c) for c in aligned_b(configs.validate(base), fmt)) is want
        flip = dict((n, make) for n, _, make in PHASES)["decode A quant"]
        assert bool(flip(configs.validate(dec), {"dtype": fmt})) is want


def test_format_keys_name_tables_as_vllm_does():
    """Block FP8 tables are named with vLLM's dtype/block_shape spelling and get BLOCK_K = the
    group; per-token and per-tensor keys are apart; smem fitting uses the weight dtype."""
    from moe_serve.kernels.moe import quant_format

    key = quant_format.block_key(128, 128)
    assert configs.config_file_name(256, 256, 7168, key, "NVIDIA_H200") == \
        "E=256,N=256,K=7168,dtype=fp8_w8a8,block_shape=[128,128],device=NVIDIA_H200.json"
    assert quant_format.block_shape(key) == (128, 128) and quant_format.weight_dtype(key) == "fp8"
    assert quant_format.block_shape(quant_format.PER_TOKEN) is None
    assert quant_format.is_fp8(quant_format.PER_TOKEN) and not quant_format.is_fp8("bf16")
    for M in (1, 4, 64, 4096):
        for E, N, K, topk in [(256, 256, 7168, 8), (128, 192, 4096, 8), (128, 768, 2048, 8)]:
            cfg = selection.get_config(M, E, N, K, topk, key, device="cpu")
            assert configs.validate(cfg) == cfg and configs.block_k_of(cfg) == {128}
    assert selection.get_config(1, 256, 256, 7168, 8, "fp8", device="cpu")["BLOCK_K"] == 256


def test_format_of_checkpoints():
    from moe_serve.kernels.moe.quant_format import FP8, PER_TOKEN, FormatError, block_key, of_checkpoint

    assert of_checkpoint(None) is None
    assert of_checkpoint({"quant_method": "fp8", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}) == block_key(128, 128)
    assert of_checkpoint({"quant_method": "fp8", "activation_scheme": "static"}) == FP8
    assert of_checkpoint(None, "fp8") == FP8                    # vLLM's online fp8
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}}
    assert of_checkpoint(ct) == PER_TOKEN
    g = ct["config_groups"]["group_0"]
    g["weights"].update(strategy="block", block_structure=[128, 128])
    g["input_activations"].update(strategy="group", group_size=128)
    assert of_checkpoint(ct) == block_key(128, 128)
    g["weights"]["num_bits"] = 4
    with pytest.raises(FormatError, match="FP8"):
        of_checkpoint(ct)
    with pytest.raises(FormatError, match="awq"):
        of_checkpoint({"quant_method": "awq"})


def test_decode_split_fills_the_sms():
    """Split-K (when asked for) brings a decode kernel's programs up to ~one per SM, keeps each
    split's share of the loop, and never splits a kernel that already fills the GPU."""
    from moe_serve.kernels.moe.heuristics import decode_config, decode_split

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


def test_from_vllm_config_swaps_only_per_tensor_and_per_token_fp8_at_block_m_32():
    from moe_serve.kernels.moe import quant_format
    from moe_serve.kernels.moe.heuristics import from_vllm_config

    tile = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 3}
    for fmt in ("fp8", quant_format.PER_TOKEN):
        cfg = from_vllm_config(tile, fmt)
        assert (cfg["SWAP_AB"], cfg["BLOCK_N"], cfg["DOWN"]["SWAP_AB"], cfg["DOWN"]["BLOCK_N"]) == (True, 64, True, 64)
    for fmt in ("bf16", quant_format.block_key(128, 128)):
        cfg = from_vllm_config(tile, fmt)
        assert (cfg["SWAP_AB"], cfg["BLOCK_N"], cfg["DOWN"]["BLOCK_N"]) == (False, 32, 64)
    small = from_vllm_config({**tile, "BLOCK_SIZE_M": 16}, "fp8")      # measured faster unswapped
    assert (small["SWAP_AB"], small["BLOCK_N"]) == (False, 32)
