"""Per-request timeout (408 / final error event), the JSON access log and the start-up warm-up
requests, on a real server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server
from moe_serve.service.warmup import warmup_requests
from tests.monitoring_helpers import scrape, value

pytestmark = pytest.mark.engine
SECRET_PROMPT = "the-quick-secret-prompt-4711"
LONG = {"model": MODEL_NAME, "prompt": SECRET_PROMPT, "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(Path(tmp_path_factory.mktemp("timeout")), "--request-timeout", "1.0", "--access-log-json",
                       api_key="k-timeout-0123456789")
    yield srv
    srv.stop()


def test_warmup_requests_pass_auth_and_stay_out_of_the_metrics(timed_server: ServerProcess) -> None:
    """Runs first on this module's fresh server: /health was 200, so the warm-up is done; every
    warm-up request went through auth to the engine (200) while the worker counted compiles as
    warm-up, and no request is counted yet."""
    log = timed_server.log()
    records = [json.loads(line) for line in log.splitlines() if line.startswith('{"ts"')]
    warm = [(r["path"], r["status"]) for r in records if r["client"] == "moe-serve-warmup"]
    kinds = warmup_requests(MODEL_NAME)
    assert warm == [(path, 200) for _, path, _ in kinds]
    assert all(f"warm-up {kind}: 200 in" in log for kind, _, _ in kinds)
    assert "request path warmed up in" in log and f"({len(kinds)} of {len(kinds)} kinds answered 200)" in log
    assert log.index("Triton JIT phase -> warmup (request warm-up)") < log.index("request path warmed up")
    assert "could not set the workers' Triton JIT phase" not in log
    text = httpx.get(timed_server.base_url + "/metrics", headers=timed_server.headers).text
    counted = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("moe_serve_requests_total{")]
    assert counted and sum(counted) == 0


def test_non_streamed_request_over_the_timeout_gets_408(timed_server: ServerProcess) -> None:
    resp = httpx.post(timed_server.base_url + "/v1/completions", json=LONG, headers=timed_server.headers, timeout=60)
    assert resp.status_code == 408, resp.text
    assert resp.json()["error"]["code"] == "timeout"
    health = httpx.get(timed_server.base_url + "/health").json()
    assert health["running"] == 0


def test_stream_over_the_timeout_ends_with_an_error_event(timed_server: ServerProcess) -> None:
    with httpx.stream("POST", timed_server.base_url + "/v1/completions", json={**LONG, "stream": True},
                      headers=timed_server.headers, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    assert len(events) > 3  # it streamed tokens before the deadline


def test_responses_stream_over_the_timeout_ends_with_an_error_event(timed_server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "input": SECRET_PROMPT, "max_output_tokens": 4000, "stream": True}
    with httpx.stream("POST", timed_server.base_url + "/v1/responses", json=body, headers=timed_server.headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        lines = list(resp.iter_lines())
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert "event: response.created" in lines
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"


def test_a_mix_of_request_features_compiles_nothing_while_serving(timed_server: ServerProcess) -> None:
    """Every kind the warm-up sends, again, as clients: no Triton compile in the serving phase
    (on the CPU engine vLLM compiles no Triton kernel, so this reads 0 there by construction; on
    a GPU it is the check that the warm-up covered every feature)."""
    with httpx.Client(base_url=timed_server.base_url, headers=timed_server.headers, timeout=60) as http:
        for kind, path, body in warmup_requests(MODEL_NAME):
            resp = http.post(path, json={**body, "stream": False} if "stream" in body else body)
            assert resp.status_code == 200, (kind, resp.text[:300])
    samples = scrape(timed_server.base_url, timed_server.headers)
    assert value(samples, "moe_serve_triton_jit_compiles_total", phase="serving") == 0
    assert "during serving" not in timed_server.log()  # the plugin's warning for a serving-phase compile


def test_short_requests_are_unaffected(timed_server: ServerProcess) -> None:
    resp = httpx.post(timed_server.base_url + "/v1/completions", headers=timed_server.headers, timeout=60,
                      json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 200


def test_access_log_is_json_without_prompts_or_keys(timed_server: ServerProcess) -> None:
    httpx.get(timed_server.base_url + "/v1/models", headers=timed_server.headers)
    deadline = time.monotonic() + 10  # the line is written after the response has been sent
    while True:
        log = timed_server.log()
        records = [json.loads(line) for line in log.splitlines() if line.startswith('{"ts"')]
        if any(r["path"] == "/v1/models" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert any(r["path"] == "/v1/models" and r["status"] == 200 for r in records)
    assert any(r["path"] == "/v1/completions" and r["status"] == 408 for r in records)
    assert all({"ts", "method", "path", "status", "duration_ms", "client"} <= set(r) for r in records)
    assert SECRET_PROMPT not in log
    assert "k-timeout-0123456789" not in log
