"""Flags to Settings (no server): the shared-server defaults and how they are turned off."""

from __future__ import annotations

import pytest

from moe_serve.kernels.config import PluginConfig
from moe_serve.service.cli import settings_from_args
from moe_serve.service.settings import Settings, SettingsError, visible_gpu_count

_STOCK = PluginConfig(mode="vllm", fused_router=False, dense_gemv=False)   # --moe-kernels vllm's


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REQUEST_TIMEOUT", "ENABLE_DOCS", "FORWARDED_ALLOW_IPS", "MODEL", "SERVED_MODEL_NAME",
                 "FUSED_ROUTER", "MOE_KERNELS", "EXPERT_STATS", "EXPERT_STATS_WINDOW", *map(str.upper, PluginConfig.model_fields)):
        monkeypatch.delenv("MOE_SERVE_" + name, raising=False)


def test_request_timeout_defaults_to_600_s_and_0_or_none_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from_args([]).request_timeout_s == 600.0 == Settings().request_timeout_s
    for off in ("0", "none", "None", "off"):
        assert settings_from_args(["--request-timeout", off]).request_timeout_s is None, off
    assert settings_from_args(["--request-timeout", "2.5"]).request_timeout_s == 2.5
    monkeypatch.setenv("MOE_SERVE_REQUEST_TIMEOUT", "none")
    assert settings_from_args([]).request_timeout_s is None
    monkeypatch.setenv("MOE_SERVE_REQUEST_TIMEOUT", "30")
    assert settings_from_args([]).request_timeout_s == 30.0
    with pytest.raises(SystemExit):
        settings_from_args(["--request-timeout", "soon"])
    with pytest.raises(SettingsError):
        settings_from_args(["--request-timeout", "-1"])


def test_docs_and_proxy_headers_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    default = settings_from_args([])
    assert not default.enable_docs and default.forwarded_allow_ips is None
    on = settings_from_args(["--enable-docs", "--forwarded-allow-ips", "10.0.0.1,10.0.0.2"])
    assert on.enable_docs and on.forwarded_allow_ips == "10.0.0.1,10.0.0.2"
    monkeypatch.setenv("MOE_SERVE_ENABLE_DOCS", "1")
    assert settings_from_args([]).enable_docs


def test_fused_router_is_on_with_our_kernels_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from_args([]).uses_fused_router
    assert not settings_from_args(["--moe-kernels", "vllm"]).uses_fused_router   # off, not refused
    assert not settings_from_args(["--no-fused-router"]).uses_fused_router
    assert settings_from_args(["--fused-router"]).uses_fused_router
    with pytest.raises(SettingsError, match="--moe-kernels optimized"):
        settings_from_args(["--fused-router", "--moe-kernels", "vllm"])
    monkeypatch.setenv("MOE_SERVE_FUSED_ROUTER", "0")
    assert not settings_from_args([]).uses_fused_router
    assert settings_from_args(["--fused-router"]).uses_fused_router              # the flag wins
    monkeypatch.setenv("MOE_SERVE_FUSED_ROUTER", "maybe")
    with pytest.raises(SettingsError, match="MOE_SERVE_FUSED_ROUTER"):
        settings_from_args([])


def test_dense_gemv_is_on_with_our_kernels_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from_args([]).uses_dense_gemv                                # where tables list it
    assert not settings_from_args(["--moe-kernels", "vllm"]).uses_dense_gemv
    assert settings_from_args(["--dense-gemv"]).uses_dense_gemv
    assert not settings_from_args(["--no-dense-gemv"]).uses_dense_gemv
    with pytest.raises(SettingsError, match="--moe-kernels optimized"):
        settings_from_args(["--dense-gemv", "--moe-kernels", "vllm"])
    monkeypatch.setenv("MOE_SERVE_DENSE_GEMV", "0")
    assert not settings_from_args([]).uses_dense_gemv
    assert settings_from_args(["--dense-gemv"]).uses_dense_gemv                  # the flag wins
    monkeypatch.setenv("MOE_SERVE_DENSE_GEMV", "sometimes")
    with pytest.raises(SettingsError, match="MOE_SERVE_DENSE_GEMV"):
        settings_from_args([])


def test_expert_stats_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    default = settings_from_args([])
    assert default.expert_stats and default.expert_stats_window_s == 60.0
    assert not settings_from_args(["--no-expert-stats"]).expert_stats
    assert settings_from_args(["--expert-stats-window", "15"]).expert_stats_window_s == 15.0
    with pytest.raises(SettingsError, match="--expert-stats-window"):
        settings_from_args(["--expert-stats-window", "0"])
    monkeypatch.setenv("MOE_SERVE_EXPERT_STATS", "off")
    assert not settings_from_args([]).expert_stats
    assert settings_from_args(["--expert-stats"]).expert_stats                   # the flag wins


def test_the_router_hook_and_the_expert_stats_key_their_own_compile_cache(embedded_model_dir: str) -> None:
    """runner_gate, the expert load counting and the dense GEMV op change the traced graph (the
    counting on vLLM's CPU engine, where torch.compile traces the MoE layer); vLLM's AOT compile
    cache keys on the config, so a server with any of them must not share compiled graphs with one
    without."""
    from moe_serve.service.engine import (DENSE_GEMV_GRAPH, DENSE_GEMV_KEY, EXPERT_STATS_GRAPH, EXPERT_STATS_KEY,
                                RUNNER_GATE_KEY, build_engine_args)

    def extra(*flags: str) -> dict:
        config = build_engine_args(settings_from_args(list(flags)), embedded_model_dir).additional_config
        assert PluginConfig.from_vllm(config, {}) == settings_from_args(list(flags)).plugin_config()
        return {k: v for k, v in config.items() if k != "moe_serve"}

    stats = {EXPERT_STATS_KEY: EXPERT_STATS_GRAPH} if visible_gpu_count() == 0 else {}   # traced on CPU only
    dense = {DENSE_GEMV_KEY: DENSE_GEMV_GRAPH}
    assert extra() == {RUNNER_GATE_KEY: True, **stats, **dense}
    assert extra("--no-fused-router", "--no-dense-gemv") == stats == extra("--moe-kernels", "vllm")
    assert extra("--no-fused-router", "--no-expert-stats", "--no-dense-gemv") == {}
    assert extra("--engine-arg", 'additional_config={"x": 1}') == {"x": 1, RUNNER_GATE_KEY: True, **stats, **dense}
    assert extra("--no-fused-router", "--no-expert-stats") == dense


def test_the_engine_gets_vllm_serves_batch_defaults(monkeypatch: pytest.MonkeyPatch, embedded_model_dir: str) -> None:
    """vLLM picks max_num_batched_tokens and max_num_seqs by usage context (and GPU): `vllm serve`
    builds its engine in the OpenAI API server's, so moe-serve must too (on an H200 the engine
    context's max_num_batched_tokens is 2048, `vllm serve`'s 8192). At TP = 2 on CPU the two
    contexts differ as well."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_serve.service import vllm_compat
    from moe_serve.service.engine import build_async_llm, build_engine_args

    class Built(Exception):
        pass

    def capture(self: AsyncLLM, vllm_config: object, *args: object, **kwargs: object) -> None:
        raise Built(vllm_config)

    monkeypatch.setattr(AsyncLLM, "__init__", capture)
    monkeypatch.setattr(AsyncLLM, "__del__", lambda self: None)
    with pytest.raises(Built) as built:
        build_async_llm(build_engine_args(settings_from_args(["-tp", "2"]), embedded_model_dir))
    ours = built.value.args[0].scheduler_config
    cli = vllm_compat.serve_args(embedded_model_dir, "m", ["--tensor-parallel-size", "2"])  # as vllm serve parses
    serve = AsyncEngineArgs.from_cli_args(cli).create_engine_config(UsageContext.OPENAI_API_SERVER).scheduler_config
    engine_ctx = AsyncEngineArgs.from_cli_args(cli).create_engine_config(UsageContext.ENGINE_CONTEXT).scheduler_config
    assert (ours.max_num_batched_tokens, ours.max_num_seqs) == (serve.max_num_batched_tokens, serve.max_num_seqs)
    assert (serve.max_num_batched_tokens, serve.max_num_seqs) != (engine_ctx.max_num_batched_tokens,
                                                                  engine_ctx.max_num_seqs)


def test_engine_args_are_vllm_serves_but_for_the_cpu_kv_budget(embedded_model_dir: str) -> None:
    """With vLLM's kernels, moe-serve's engine args are what `vllm serve --model M` parses, field by
    field, but for the fixed CPU KV-cache budget (README: --gpu-memory-utilization) and, on CPU, the
    expert load's compile-cache key. vLLM's CLI defaults differ from its dataclass's
    (mm_device_do_normalize: None against True)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from moe_serve.service import vllm_compat
    from moe_serve.service.engine import EXPERT_STATS_GRAPH, EXPERT_STATS_KEY, build_engine_args

    ours = build_engine_args(settings_from_args(["--model", embedded_model_dir, "--moe-kernels", "vllm"]),
                             embedded_model_dir)
    serve = AsyncEngineArgs.from_cli_args(vllm_compat.serve_args(embedded_model_dir, ours.served_model_name[0], []))
    differ = {f.name: (getattr(ours, f.name), getattr(serve, f.name)) for f in dataclasses.fields(AsyncEngineArgs)
              if getattr(ours, f.name) != getattr(serve, f.name)}
    if visible_gpu_count() == 0:
        assert differ.pop("kv_cache_memory_bytes") == (settings_from_args([]).cpu_kv_cache_bytes, None)
        assert differ.pop("additional_config") == ({EXPERT_STATS_KEY: EXPERT_STATS_GRAPH,  # traced on CPU
                                                    **_STOCK.additional_config()}, {})
    else:
        assert differ.pop("additional_config") == (_STOCK.additional_config(), {})
    assert differ == {}


def test_the_plugin_settings_go_to_the_engine_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags' choices, and for the settings without a flag --engine-arg additional_config's
    "moe_serve" over MOE_SERVE_*; a flag's setting given in additional_config is refused."""
    monkeypatch.setenv("MOE_SERVE_BLOCK_PDL", "1")
    monkeypatch.setenv("MOE_SERVE_MOE_ROUTING", "ours")
    cfg = settings_from_args(["--no-dense-gemv", "--expert-stats-window", "5", "--engine-arg",
                              'additional_config={"moe_serve": {"moe_routing": "vllm"}}']).plugin_config()
    assert cfg == PluginConfig(dense_gemv=False, expert_stats_window_s=5.0, block_pdl=True, moe_routing="vllm")
    assert settings_from_args(["--moe-kernels", "vllm"]).plugin_config().mode == "vllm"
    with pytest.raises(SettingsError, match="--no-dense-gemv"):
        settings_from_args(["--engine-arg", 'additional_config={"moe_serve": {"dense_gemv": false}}'])


@pytest.mark.parametrize("env,flags,named", [
    ({"MOE_SERVE_BLOCK_PDL": "2"}, [], "MOE_SERVE_BLOCK_PDL"),
    ({}, ["--engine-arg", 'additional_config={"moe_serve": {"fp8_moe_gemv": "sometimes"}}'],
     "additional_config['moe_serve']['fp8_moe_gemv']"),
    ({}, ["--engine-arg", 'additional_config={"moe_serve": {"no_such_switch": 1}}'], "'no_such_switch'")])
def test_moe_serve_stops_at_start_on_a_bad_plugin_setting(env: dict, flags: list, named: str) -> None:
    """The real `moe-serve` command exits 2 naming the setting, in its API process before an engine
    starts."""
    import os
    import subprocess
    import sys
    import time

    began = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "moe_serve.service", "--port", "0", *flags], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env})
    assert res.returncode == 2 and res.stderr.startswith("moe-serve: error:"), res.stderr[-2000:]
    assert named in res.stderr and "Traceback" not in res.stderr and time.monotonic() - began < 60


def test_served_model_name_is_never_a_path(tmp_path) -> None:
    model_dir = tmp_path / "Mixtral-8x7B"
    model_dir.mkdir()
    assert settings_from_args([]).model_name == "moe-serve-tiny-mixtral"
    assert settings_from_args(["--model", str(model_dir)]).model_name == "Mixtral-8x7B"
    assert settings_from_args(["--model", str(model_dir) + "/"]).model_name == "Mixtral-8x7B"
    assert settings_from_args(["--model", "./some/dir"]).model_name == "dir"
    assert settings_from_args(["--model", "mistralai/Mixtral-8x7B-v0.1"]).model_name == "mistralai/Mixtral-8x7B-v0.1"
    assert settings_from_args(["--model", str(model_dir), "--served-model-name", "mx"]).model_name == "mx"


def test_help_lists_the_subcommands() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "moe_serve.service", "--help"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "moe-serve tune" in out and "moe-serve explain" in out and "--triton-version" in out
    assert "moe-serve bench serve|kernels|tables" in out
