"""service/warmup.py against a small stand-in app (no engine): what the warm-up sends, and how
its requests are told apart from clients'. The real-engine side is in test_timeout_and_access_log."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from service.warmup import is_warmup, warm_up_request_path


def _app(seen: list[dict], status: int = 200) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> JSONResponse:
        seen.append({"path": request.url.path, "warmup": is_warmup(request),
                     "auth": request.headers.get("authorization"), "body": await request.json()})
        return JSONResponse({}, status_code=status)

    app.post("/v1/completions")(record)
    app.post("/v1/chat/completions")(record)
    return app


def _state(api_keys: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(settings=SimpleNamespace(api_keys=api_keys, model_name="m"), warmed=False)


def test_warmup_sends_a_completion_and_a_chat_with_the_first_key() -> None:
    seen: list[dict] = []
    state = _state(("k1", "k2"))
    asyncio.run(warm_up_request_path(_app(seen), state))
    assert state.warmed
    assert [s["path"] for s in seen] == ["/v1/completions", "/v1/chat/completions"]
    assert all(s["warmup"] and s["auth"] == "Bearer k1" for s in seen)
    assert all(s["body"]["model"] == "m" and s["body"]["stream"] and s["body"]["max_tokens"] == 2 for s in seen)
    assert seen[1]["body"]["messages"] == [{"role": "user", "content": "Hello"}]


def test_client_requests_are_not_warmup() -> None:
    seen: list[dict] = []
    with TestClient(_app(seen)) as client:
        client.post("/v1/completions", json={})
    assert seen == [{"path": "/v1/completions", "warmup": False, "auth": None, "body": {}}]


def test_a_failing_warmup_is_logged_and_does_not_block_health(caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    asyncio.run(warm_up_request_path(_app([], status=503), state))
    assert state.warmed
    assert "warm-up /v1/completions answered 503" in caplog.text
