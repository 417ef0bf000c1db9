"""moe-serve's /start_profile and /stop_profile (what the yardstick's --profile calls): present only
with vLLM's profiler configured, as in `vllm serve`, and behind the API key like every route.
The app is built in-process without starting its engine; tests/test_bench_serve_e2e.py profiles a
real server through them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moe_serve.kernels.plugin.plugin_metrics import RUNTIME_DIR_ENV
from moe_serve.service.app import create_app
from moe_serve.service.cli import settings_from_args
from moe_serve.service.engine import build_engine_args

KEY = "profile-key-0123456789"
PROFILER = json.dumps({"profiler": "torch", "torch_profiler_dir": "/tmp/moe-serve-profile-test"})


def _client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *flags: str) -> TestClient:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))       # create_app exports it: keep it to this test
    return TestClient(create_app(settings_from_args(["--api-key", KEY, *flags]), "/unused"))


def test_no_profile_routes_without_a_profiler(monkeypatch, tmp_path) -> None:
    client = _client(monkeypatch, tmp_path)
    for path in ("/start_profile", "/stop_profile"):
        resp = client.post(path, headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 404 and resp.json()["error"]["message"]


def test_profile_routes_with_a_profiler_need_the_key_and_a_serving_engine(monkeypatch, tmp_path) -> None:
    client = _client(monkeypatch, tmp_path, "--engine-arg", f"profiler_config={PROFILER}")
    for path in ("/start_profile", "/stop_profile"):
        assert client.post(path).status_code == 401
        resp = client.post(path, headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_not_ready"


def test_the_profiler_config_reaches_the_engine_as_vllms_own_config(embedded_model_dir) -> None:
    from vllm.config import ProfilerConfig

    args = build_engine_args(settings_from_args(["--engine-arg", f"profiler_config={PROFILER}"]), embedded_model_dir)
    assert isinstance(args.profiler_config, ProfilerConfig) and args.profiler_config.profiler == "torch"
