"""Shared fixtures: one real server (vLLM CPU engine, embedded model) per test session."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server_proc import MODEL_NAME, RunningServer, start_server

API_KEY = "test-key-0123456789"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The real server with an API key set, shared by every test that needs an engine."""
    srv = start_server(tmp_path_factory.mktemp("server"), api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def model() -> str:
    return MODEL_NAME
