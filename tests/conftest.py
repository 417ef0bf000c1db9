"""Shared fixtures: the real server (vLLM CPU engine, embedded model) per test session, and a second
one with strict access flags for the tests that need them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server
from tests.plugin_env import plugin_server_env

API_KEY = "test-key-0123456789"
STRICT_KEY = "strict-key-0123456789"
STRICT_METRICS_KEY = "strict-metrics-key-0123456789"
STRICT_COMPILE_BUDGET_S = 300  # long: a compile that stops early was cancelled, not timed out


def strict_flags(model_dir: str) -> list[str]:
    """The second server's flags but its --api-key STRICT_KEY (also used to rebuild its app in-process)."""
    return ["--model", model_dir, "--metrics-api-key", STRICT_METRICS_KEY, "--enable-docs",
            "--forwarded-allow-ips", "127.0.0.1", "--access-log-json",
            "--max-concurrent-requests", "32", "--max-queued-requests", "2",
            "--structured-output-compile-budget", str(STRICT_COMPILE_BUDGET_S), "--no-expert-stats",
            "--dense-gemv"]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The real server with an API key set, shared by every test that needs an engine.

    Through the test-only vLLM plugin (tests/vllm_test_plugin), its worker compiles a probe
    Triton kernel (for sm_90, on the CPU) once in warm-up and once after serving starts, so the
    JIT-compile series, dashboard panels and alert inputs carry real data on a machine whose MoE
    path never compiles Triton.
    """
    tmp = tmp_path_factory.mktemp("server")
    env = {**plugin_server_env(probe_kernel="1"), "TRITON_CACHE_DIR": str(tmp / "triton-cache")}
    srv = start_server(tmp, api_key=API_KEY, env=env)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    from moe_serve.service.embedded_model import ensure_embedded_model

    return str(ensure_embedded_model())


@pytest.fixture(scope="session")
def strict_server(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: str) -> Iterator[ServerProcess]:
    """A second real server for the non-default flags (strict_flags): the embedded model given
    by its path (default served name: the directory's name), an API key and a separate
    /metrics key, docs on, 127.0.0.1 as a trusted proxy, a JSON access log, 32 running engine
    sequences + 2 queued requests, a 300 s structured-output compile budget, no expert load
    statistics, the dense GEMV hook; vLLM's Responses API store on (VLLM_ENABLE_RESPONSES_API_STORE=1). Its
    `headers` carry STRICT_KEY."""
    srv = start_server(tmp_path_factory.mktemp("strict"), *strict_flags(embedded_model_dir), api_key=STRICT_KEY,
                       env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def model() -> str:
    return MODEL_NAME
