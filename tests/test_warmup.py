"""service/warmup.py against a small stand-in app (no engine): what the warm-up sends, how its
requests are told apart from clients', its bounds, and the workers' JIT phase around it. The
real-engine side is in test_timeout_and_access_log (every kind answered 200)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from moe_serve.service import warmup
from moe_serve.service.warmup import is_warmup, warm_up_request_path, warmup_requests

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# One request field per feature vLLM may compile a kernel for on its first use.
FEATURES = {"response_format", "structured_outputs", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "logit_bias", "top_k", "top_p", "min_p", "logprobs", "top_logprobs", "prompt_logprobs", "n", "seed",
            "min_tokens", "bad_words", "tools"}


def _app(seen: list[dict], status: int = 200, delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> JSONResponse:
        seen.append({"path": request.url.path, "warmup": is_warmup(request),
                     "auth": request.headers.get("authorization"), "body": await request.json()})
        await asyncio.sleep(delay_s)
        return JSONResponse({}, status_code=status)

    for path in PATHS:
        app.post(path)(record)
    return app


def _state(api_keys: tuple[str, ...] = ()) -> SimpleNamespace:
    phases: list[str] = []

    async def set_worker_jit_phase(phase: str) -> None:
        phases.append(phase)

    return SimpleNamespace(settings=SimpleNamespace(api_keys=api_keys, model_name="m"), warmed=False, phases=phases,
                           engine=SimpleNamespace(set_worker_jit_phase=set_worker_jit_phase),
                           metrics=SimpleNamespace(vllm_series=None))


def test_warmup_sends_every_kind_with_the_first_key_in_the_workers_warmup_phase() -> None:
    seen: list[dict] = []
    state = _state(("k1", "k2"))
    asyncio.run(warm_up_request_path(_app(seen), state))
    assert state.warmed and state.phases == ["warmup", "serving"]
    assert [s["path"] for s in seen] == [path for _, path, _ in warmup_requests("m")]
    assert all(s["warmup"] and s["auth"] == "Bearer k1" and s["body"]["model"] == "m" for s in seen)
    assert [s["body"].get("stream") for s in seen[:2]] == [True, True]  # the request path, streamed
    assert seen[1]["body"]["messages"] == [{"role": "user", "content": "Hello"}]
    assert FEATURES <= {key for s in seen for key in s["body"]}
    assert all(s["body"].get("max_tokens", s["body"].get("max_output_tokens")) <= 8 for s in seen)


def test_client_requests_are_not_warmup() -> None:
    seen: list[dict] = []
    with TestClient(_app(seen)) as client:
        client.post("/v1/completions", json={})
    assert seen == [{"path": "/v1/completions", "warmup": False, "auth": None, "body": {}}]


def test_a_failing_warmup_is_logged_and_does_not_block_health(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moe_serve.service.warmup")
    state = _state()
    seen: list[dict] = []
    asyncio.run(warm_up_request_path(_app(seen, status=503), state))
    assert state.warmed and state.phases == ["warmup", "serving"]
    assert len(seen) == len(warmup_requests("m"))  # one failure does not stop the others
    assert "warm-up stream completion (/v1/completions) answered 503" in caplog.text
    assert "0 of 15 kinds answered 200" in caplog.text


def test_a_refused_kind_is_logged_as_information(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moe_serve.service.warmup")
    asyncio.run(warm_up_request_path(_app([], status=400), _state()))
    refused = [r for r in caplog.records if "answered 400" in r.getMessage()]
    assert refused and all(r.levelno == logging.INFO for r in refused)


def test_the_warmup_is_bounded(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(warmup, "BUDGET_S", 0.15)
    monkeypatch.setattr(warmup, "REQUEST_TIMEOUT_S", 0.1)
    seen: list[dict] = []
    state = _state()
    asyncio.run(warm_up_request_path(_app(seen, delay_s=1.0), state))
    assert state.warmed and state.phases == ["warmup", "serving"]
    assert 1 <= len(seen) < len(warmup_requests("m"))
    assert "took over 0 s; abandoned" in caplog.text and "skipped" in caplog.text and "responses" in caplog.text
