"""Warm the request path once before /health turns 200.

The first request after start-up pays one-time costs in the API process (2026-11-29, cProfile on
the CPU engine: FastAPI's first endpoint-context extraction via inspect.getsourcelines ~15 ms,
the tokenizer's first encode ~15 ms, vLLM's supported-tasks round trip to the engine core
~10 ms; the first warm-up completion took 104.7 ms server-side, the chat after it 31.4 ms). A
generation called on the engine alone does not reach them, so one streamed completion and one
streamed chat request (2 tokens each) go through the whole app, middleware and routes
included, in-process over ASGI (no socket). What this cannot remove is the engine's slower
answer after it sat idle (bench/idle_probe.py: +120-210 ms after 2-10 s on the CPU engine, the
same for vLLM's api_server). The warm-up requests carry a mark in their ASGI scope that only
this process can put there (a private object under a scope key; uvicorn builds a client's scope
from the socket, and no header, address or proxy header reaches that key): their metrics go to
a private registry, so Prometheus shows client traffic only. Their client address
WARMUP_CLIENT labels them in the access log and identifies nothing. A failing warm-up is logged
and does not block serving.
"""

from __future__ import annotations

import logging
import time

import httpx
from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from service.state import ServerState

logger = logging.getLogger(__name__)
WARMUP_CLIENT = ("moe-serve-warmup", 0)
_SCOPE_KEY = "moe_serve.warmup"
_MARK = object()  # exists only in this process; compared by identity


def is_warmup(request: Request) -> bool:
    """True for the start-up warm-up requests only; nothing a client sends can make it true."""
    return request.scope.get(_SCOPE_KEY) is _MARK


def _marked(app: ASGIApp) -> ASGIApp:
    """`app` with every request's scope carrying the warm-up mark."""

    async def marked_app(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, _SCOPE_KEY: _MARK}, receive, send)

    return marked_app


async def warm_up_request_path(app: FastAPI, state: ServerState) -> None:
    """Send the warm-up requests through `app`; sets state.warmed (also when they fail)."""
    began = time.perf_counter()
    headers = {"Authorization": f"Bearer {state.settings.api_keys[0]}"} if state.settings.api_keys else {}
    common = {"model": state.settings.model_name, "max_tokens": 2, "stream": True, "ignore_eos": True}
    requests = (("/v1/completions", {**common, "prompt": "Hello, world"}),
                ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Hello"}]}))
    try:
        transport = httpx.ASGITransport(app=_marked(app), client=WARMUP_CLIENT)
        async with httpx.AsyncClient(transport=transport, base_url="http://moe-serve-warmup") as client:
            for path, body in requests:
                response = await client.post(path, json=body, headers=headers)
                if response.status_code != 200:
                    logger.warning("warm-up %s answered %d: %s", path, response.status_code, response.text[:300])
    except Exception:  # noqa: BLE001 - serving matters more than the warm-up
        logger.exception("warm-up of the request path failed; serving anyway")
    finally:
        state.warmed = True
    logger.info("request path warmed up in %.0f ms", (time.perf_counter() - began) * 1000)
