"""The scale-out flags (no server): --distributed-executor-backend and --pipeline-parallel-size
reach vLLM's AsyncEngineArgs, TP beyond one node only over Ray, and vLLM's Ray executors hand the
server's MOE_SERVE_* variables to their workers."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from moe_serve.service.cli import settings_from_args
from moe_serve.service.engine import RAY_ENV_PREFIXES, build_engine_args, default_engine_env
from moe_serve.service.settings import SettingsError


@pytest.fixture(autouse=True)
def _own_env() -> Iterator[None]:
    """No MOE_SERVE_* from outside; what a test (default_engine_env) sets is undone after it."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("MOE_SERVE_")] + [RAY_ENV_PREFIXES]:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_backend_and_pipeline_flags_reach_the_engine_args(embedded_model_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from_args(["--distributed-executor-backend", "ray", "-tp", "2", "-pp", "2"])
    args = build_engine_args(settings, embedded_model_dir)
    assert (args.distributed_executor_backend, args.tensor_parallel_size, args.pipeline_parallel_size) == \
        ("ray", 2, 2)
    default = build_engine_args(settings_from_args(["-tp", "1"]), embedded_model_dir)
    assert (default.distributed_executor_backend, default.pipeline_parallel_size) == (None, 1)  # vLLM decides
    monkeypatch.setenv("MOE_SERVE_DISTRIBUTED_EXECUTOR_BACKEND", "ray")
    monkeypatch.setenv("MOE_SERVE_PIPELINE_PARALLEL_SIZE", "4")
    from_env = settings_from_args([])
    assert (from_env.distributed_executor_backend, from_env.pipeline_parallel_size) == ("ray", 4)


def test_engine_arg_spelling_is_the_same_backend() -> None:
    settings = settings_from_args(["--engine-arg", "distributed_executor_backend=ray", "-tp", "16"])
    assert settings.executor_backend == "ray" and settings.distributed_executor_backend is None
    assert settings_from_args(["--distributed-executor-backend", "mp",
                               "--engine-arg", "distributed_executor_backend=ray"]).executor_backend == "ray"


def test_more_than_one_nodes_gpus_only_over_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from_args(["--distributed-executor-backend", "ray", "-tp", "16"]).tensor_parallel_size == 16
    with pytest.raises(SettingsError, match="tensor-parallel-size"):
        settings_from_args(["-tp", "16"])
    with pytest.raises(SettingsError, match="tensor-parallel-size"):
        settings_from_args(["--distributed-executor-backend", "mp", "-tp", "9"])
    with pytest.raises(SettingsError, match="pipeline-parallel-size"):
        settings_from_args(["-pp", "0"])
    with pytest.raises(SystemExit):
        settings_from_args(["--distributed-executor-backend", "slurm"])
    monkeypatch.setenv("MOE_SERVE_DISTRIBUTED_EXECUTOR_BACKEND", "slurm")  # env defaults skip argparse's choices
    with pytest.raises(SettingsError, match="distributed-executor-backend"):
        settings_from_args([])


def test_vllms_legacy_ray_executor_copies_our_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The V2 executor copies every variable; the legacy one only vLLM's and listed prefixes."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    monkeypatch.setenv("MOE_SERVE_MOE_KERNELS", "vllm")
    assert "MOE_SERVE_MOE_KERNELS" not in get_env_vars_to_copy()
    monkeypatch.setenv(RAY_ENV_PREFIXES, "MYAPP_")
    default_engine_env()
    default_engine_env()  # idempotent
    assert os.environ[RAY_ENV_PREFIXES] == "MYAPP_,MOE_SERVE_"  # the user's prefixes stay
    assert "MOE_SERVE_MOE_KERNELS" in get_env_vars_to_copy()
