"""moe_serve.kernels.config.PluginConfig: defaults, every setting's bad value refused at construction (from
the environment and from additional_config) with the setting and its allowed values named, and
additional_config winning over the environment."""
from __future__ import annotations

import subprocess
import sys

import pytest

from moe_serve.kernels.config import (KEY, PluginConfig, PluginConfigError, allowed_values, configure, current,
                            env_name)

# one bad value per setting, as the environment spells it and as additional_config would
BAD: dict[str, tuple[str, object]] = {
    "mode": ("fast", "fast"),
    "fused_router": ("maybe", "maybe"),
    "dense_gemv": ("sometimes", 2),
    "expert_stats": ("perhaps", "perhaps"),
    "expert_stats_window_s": ("-1", 0),
    "moe_routing": ("random", "random"),
    "block_pdl": ("2", "2"),
    "vllm_warmup_max_calls": ("-3", 1.5),
    "kernel_config_dir": ("", ""),
    "cache": ("", 7),
    "fuse_norm_gemv": ("x", "x"),
    "fuse_qk_norm_rope": ("x", [1]),
    "fp8_dense_gemv": ("x", {}),
    "fp8_moe_gemv": ("x", "x"),
    "decode_attention": ("maybe", 2),
}


def test_every_setting_has_a_bad_value_here_and_documented_allowed_values() -> None:
    assert set(BAD) == set(PluginConfig.model_fields)
    for name, field in PluginConfig.model_fields.items():
        assert field.description and allowed_values(name) != "?", name


def test_defaults() -> None:
    cfg = PluginConfig.from_vllm(None, {})
    assert cfg == PluginConfig()
    assert (cfg.mode, cfg.fused_router, cfg.dense_gemv, cfg.expert_stats, cfg.expert_stats_window_s) == \
        ("optimized", True, True, True, 60.0)
    assert (cfg.moe_routing, cfg.block_pdl, cfg.vllm_warmup_max_calls, cfg.kernel_config_dir, cfg.cache) == \
        ("table", False, 4096, None, None)
    assert not any((cfg.fuse_norm_gemv, cfg.fuse_qk_norm_rope, cfg.fp8_dense_gemv,
                    cfg.fp8_moe_gemv, cfg.decode_attention))


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_environment_value_is_refused_naming_the_variable(name: str) -> None:
    env_value = BAD[name][0]
    environ = {env_name(name): env_value}
    if env_value == "":          # empty counts as unset: the default, no error
        assert PluginConfig.from_vllm(None, environ) == PluginConfig()
        return
    with pytest.raises(PluginConfigError) as err:
        PluginConfig.from_vllm(None, environ)
    assert env_name(name) in str(err.value) and allowed_values(name) in str(err.value)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_additional_config_value_is_refused_naming_the_setting(name: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        PluginConfig.from_vllm({KEY: {name: BAD[name][1]}}, {})
    msg = str(err.value)
    assert f"additional_config['moe_serve']['{name}']" in msg and allowed_values(name) in msg


def test_unknown_keys_and_a_non_dict_are_refused() -> None:
    with pytest.raises(PluginConfigError, match="'dense_gemm'.*dense_gemv"):
        PluginConfig.from_vllm({KEY: {"dense_gemm": True}}, {})
    with pytest.raises(PluginConfigError, match="must be a dict"):
        PluginConfig.from_vllm({KEY: "dense_gemv=0"}, {})
    with pytest.raises(ValueError, match="frozen"):   # read-only once built
        PluginConfig().dense_gemv = False  # type: ignore[misc]


def test_environment_spellings_and_names() -> None:
    env = {"MOE_SERVE_MOE_KERNELS": "vllm", "MOE_SERVE_EXPERT_STATS_WINDOW": "5", "MOE_SERVE_DENSE_GEMV": "off",
           "MOE_SERVE_BLOCK_PDL": "1", "MOE_SERVE_MOE_ROUTING": "ours", "MOE_SERVE_VLLM_WARMUP_MAX_CALLS": "7",
           "MOE_SERVE_KERNEL_CONFIG_DIR": "/t", "MOE_SERVE_FP8_MOE_GEMV": "yes", "MOE_SERVE_PORT": "1"}
    cfg = PluginConfig.from_vllm({}, env)
    assert (cfg.mode, cfg.expert_stats_window_s, cfg.dense_gemv, cfg.block_pdl, cfg.moe_routing) == \
        ("vllm", 5.0, False, True, "ours")
    assert (cfg.vllm_warmup_max_calls, cfg.kernel_config_dir, cfg.fp8_moe_gemv) == (7, "/t", True)


def test_additional_config_wins_over_the_environment() -> None:
    env = {"MOE_SERVE_DENSE_GEMV": "0", "MOE_SERVE_BLOCK_PDL": "1", "MOE_SERVE_MOE_KERNELS": "vllm"}
    cfg = PluginConfig.from_vllm({KEY: {"dense_gemv": True, "mode": "optimized"}, "other": 1}, env)
    assert (cfg.dense_gemv, cfg.mode, cfg.block_pdl) == (True, "optimized", True)  # block_pdl: env's
    # a bad environment value under a key additional_config sets is never read
    assert PluginConfig.from_vllm({KEY: {"block_pdl": False}}, {"MOE_SERVE_BLOCK_PDL": "2"}).block_pdl is False


def test_round_trip_through_additional_config() -> None:
    cfg = PluginConfig(dense_gemv=False, moe_routing="vllm", fp8_moe_gemv=True, expert_stats_window_s=2.5)
    assert PluginConfig.from_vllm(cfg.additional_config(), {"MOE_SERVE_DENSE_GEMV": "1"}) == cfg


def test_current_is_the_configured_one_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_SERVE_MOE_ROUTING", "vllm")
    assert current().moe_routing == "vllm"
    cfg = PluginConfig(moe_routing="ours")
    configure(cfg)
    try:
        assert current() is cfg
    finally:
        configure(None)
    monkeypatch.setenv("MOE_SERVE_MOE_ROUTING", "sometimes")
    with pytest.raises(PluginConfigError, match="MOE_SERVE_MOE_ROUTING"):
        current()


def test_the_module_imports_neither_torch_nor_triton() -> None:
    code = "import sys, moe_serve.kernels.config; print(sorted({'torch', 'triton'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
