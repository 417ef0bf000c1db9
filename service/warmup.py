"""Warm the request path, and every request feature vLLM compiles a kernel for, before /health is 200.

The first request after start-up pays one-time costs in the API process (2026-11-29, cProfile on
the CPU engine: FastAPI's first endpoint-context extraction via inspect.getsourcelines ~15 ms,
the tokenizer's first encode ~15 ms, vLLM's supported-tasks round trip to the engine core
~10 ms; the first warm-up completion took 104.7 ms server-side, the chat after it 31.4 ms). A
generation called on the engine alone does not reach them, so one streamed completion and one
streamed chat request go through the whole app, middleware and routes included, in-process over
ASGI (no socket). On a GPU, a feature's first use also compiles its kernels in the workers (seen
on the H200: the first `json_schema` request compiled xgrammar's token-bitmask kernel while
serving, stalling its TP group), so one short request per feature follows (REQUESTS): structured
outputs, penalties, logit bias, top-k/top-p/min-p, logprobs, prompt logprobs, n > 1, a seed,
min_tokens/bad_words, tool calls and the Responses route. While they run, the workers count
Triton compiles as warm-up (EngineHandle.set_worker_jit_phase), so `phase="serving"` means
client traffic only. What this cannot remove is the engine's slower answer after it sat idle
(bench/idle_probe.py: +120-210 ms after 2-10 s on the CPU engine, the same for vLLM's api_server).

The warm-up requests carry a mark in their ASGI scope that only this process can put there (a
private object under a scope key; uvicorn builds a client's scope from the socket, and no header,
address or proxy header reaches that key): their metrics go to a private registry, so
Prometheus shows client traffic only. Their client address WARMUP_CLIENT labels them in the
access log and identifies nothing. The warm-up is bounded (BUDGET_S in all, REQUEST_TIMEOUT_S
each); a request the model or the limits refuse (4xx) is logged and skipped, and a failing
warm-up is logged and does not block serving.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from moe_serve.service.state import ServerState

logger = logging.getLogger(__name__)
WARMUP_CLIENT = ("moe-serve-warmup", 0)
_SCOPE_KEY = "moe_serve.warmup"
_MARK = object()  # exists only in this process; compared by identity
BUDGET_S = 120.0  # the whole warm-up; requests not started by then are skipped (logged)
REQUEST_TIMEOUT_S = 60.0
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
       "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "record", "parameters": PET}}


def is_warmup(request: Request) -> bool:
    """True for the start-up warm-up requests only; nothing a client sends can make it true."""
    return request.scope.get(_SCOPE_KEY) is _MARK


def _marked(app: ASGIApp) -> ASGIApp:
    """`app` with every request's scope carrying the warm-up mark."""

    async def marked_app(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, _SCOPE_KEY: _MARK}, receive, send)

    return marked_app


def warmup_requests(model: str) -> list[tuple[str, str, dict]]:
    """(kind, path, body) of every warm-up request, 2 output tokens each (8 for structured outputs)."""
    base = {"model": model, "max_tokens": 2}
    cmpl = {**base, "prompt": "Hello, world", "ignore_eos": True}
    chat = {**base, "messages": [{"role": "user", "content": "Hello"}]}
    sampled = {"temperature": 0.8}
    return [
        ("stream completion", "/v1/completions", {**cmpl, "stream": True}),
        ("stream chat", "/v1/chat/completions", {**chat, "stream": True, "ignore_eos": True}),
        ("json_schema", "/v1/chat/completions", {**chat, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "warmup", "schema": PET}}}),
        ("regex", "/v1/completions", {**cmpl, "structured_outputs": {"regex": "[ab]{1,4}"}}),
        ("choice", "/v1/completions", {**cmpl, "structured_outputs": {"choice": ["yes", "no"]}}),
        ("penalties", "/v1/completions", {**cmpl, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                                          "frequency_penalty": 0.5}),
        ("logit_bias", "/v1/completions", {**cmpl, "logit_bias": {"100": 1.0}}),
        ("top-k/top-p/min-p", "/v1/completions", {**cmpl, **sampled, "top_k": 5, "top_p": 0.9, "min_p": 0.05}),
        ("logprobs", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        ("prompt_logprobs", "/v1/completions", {**cmpl, "prompt_logprobs": 1}),
        ("n > 1", "/v1/completions", {**cmpl, **sampled, "n": 2}),
        ("seed", "/v1/completions", {**cmpl, **sampled, "seed": 1}),
        ("min_tokens/bad_words", "/v1/completions", {**cmpl, "min_tokens": 2, "bad_words": ["warm"]}),
        ("tools", "/v1/chat/completions", {**chat, "max_tokens": 8, "tools": [TOOL],
                                           "tool_choice": {"type": "function", "function": {"name": "record"}}}),
        ("responses", "/v1/responses", {"model": model, "input": "Hello", "max_output_tokens": 2}),
    ]


async def _send(client: httpx.AsyncClient, kind: str, path: str, body: dict, headers: dict) -> bool:
    """One warm-up request; True when it answered 200 (a stream: read to its end)."""
    began = time.perf_counter()
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        response = await client.post(path, json=body, headers=headers)
    ms = (time.perf_counter() - began) * 1000
    if response.status_code == 200:
        logger.info("warm-up %s: 200 in %.0f ms", kind, ms)
        return True
    log = logger.info if response.status_code < 500 else logger.warning  # a 4xx: refused by the model or limits
    log("warm-up %s (%s) answered %d: %s", kind, path, response.status_code, response.text[:300])
    return False


async def warm_up_request_path(app: FastAPI, state: ServerState) -> None:
    """Send the warm-up requests through `app`, the workers' JIT phase 'warmup' meanwhile; then
    offset the re-exported vLLM counters by what the warm-up added and set state.warmed (also when
    they fail)."""
    began = time.perf_counter()
    headers = {"Authorization": f"Bearer {state.settings.api_keys[0]}"} if state.settings.api_keys else {}
    requests = warmup_requests(state.settings.model_name)
    ok = 0
    await state.engine.set_worker_jit_phase("warmup")
    try:
        transport = httpx.ASGITransport(app=_marked(app), client=WARMUP_CLIENT)
        async with httpx.AsyncClient(transport=transport, base_url="http://moe-serve-warmup") as client:
            for i, (kind, path, body) in enumerate(requests):
                if time.perf_counter() - began > BUDGET_S:
                    logger.warning("warm-up over its %.0f s budget: skipped %s", BUDGET_S,
                                   ", ".join(k for k, _, _ in requests[i:]))
                    break
                try:
                    ok += await _send(client, kind, path, body, headers)
                except TimeoutError:
                    logger.warning("warm-up %s (%s) took over %.0f s; abandoned", kind, path, REQUEST_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - serving matters more than the warm-up
        logger.exception("warm-up of the request path failed; serving anyway")
    finally:
        await state.engine.set_worker_jit_phase("serving")
        if state.metrics.vllm_series is not None:  # vLLM's own request counters leave the warm-up out too
            state.metrics.vllm_series.offset_now()
        state.warmed = True
    logger.info("request path warmed up in %.0f ms (%d of %d kinds answered 200)",
                (time.perf_counter() - began) * 1000, ok, len(requests))
