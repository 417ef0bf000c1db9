"""A client that disconnects mid-stream (or mid-request) leaves nothing running in the engine."""

from __future__ import annotations

import time

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.engine
LONG = {"model": MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 4000, "ignore_eos": True}


def _generated_tokens(server: ServerProcess) -> float:
    text = httpx.get(server.base_url + "/metrics", headers=server.headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("moe_serve_generation_tokens_total{"))


def _wait_idle(server: ServerProcess, timeout: float = 3.0) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = httpx.get(server.base_url + "/health").json()
        if body["unfinished_requests"] == 0 and body["running"] == 0:
            return body
        time.sleep(0.1)
    raise AssertionError(f"engine still busy after {timeout} s: {body}")


def test_disconnect_mid_stream_aborts_the_engine_request(server: ServerProcess) -> None:
    _wait_idle(server, 60)
    before = _generated_tokens(server)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            busy = httpx.get(server.base_url + "/health").json()
            assert busy["unfinished_requests"] == 1
    _wait_idle(server)
    assert _generated_tokens(server) - before < LONG["max_tokens"] / 2  # aborted, not run to the end


def test_disconnect_during_non_streamed_request_aborts_it(server: ServerProcess) -> None:
    _wait_idle(server, 60)
    before = _generated_tokens(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=LONG, headers=server.headers, timeout=0.5)
    _wait_idle(server)
    assert _generated_tokens(server) - before < LONG["max_tokens"] * 3 / 4  # aborted, not run to the end


def test_disconnect_storm_leaves_the_engine_idle_and_serving(server: ServerProcess) -> None:
    """Many clients drop mid-stream at once; everything is aborted and the server keeps serving."""
    import threading

    _wait_idle(server, 60)
    started = threading.Barrier(24 + 1, timeout=120)

    def drop_after_first_chunk() -> None:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
                next(line for line in resp.iter_lines() if line.startswith("data: {"))
                started.wait()

    threads = [threading.Thread(target=drop_after_first_chunk) for _ in range(24)]
    for t in threads:
        t.start()
    started.wait()
    for t in threads:
        t.join(60)
    _wait_idle(server, 10)
    ok = httpx.post(server.base_url + "/v1/completions", headers=server.headers, timeout=60,
                    json={"model": MODEL_NAME, "prompt": "after the storm", "max_tokens": 4})
    assert ok.status_code == 200
