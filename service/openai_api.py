"""OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.errors import APIError, sse_error_event
from service.metrics import RequestObserver, status_for_http
from service.generation import Delta, PromptJob, as_api_error, generate_deltas
from service.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from service.responses import ResponseFormat
from service.sampling import (check_common_limits, check_prompt_ids, resolve_max_tokens,
                              sampling_params)
from service.state import ServerState
from service.streaming import DONE_EVENT, ClientGone, SSEResponse, sse_event, until_disconnect
from service.warmup import is_warmup

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _checked_state(request: Request, req: SamplingFields) -> ServerState:
    """Checks shared by both routes: model name, engine up, limits, unsupported logprobs."""
    state = _state(request)
    _check_model_and_engine(state, req)
    check_common_limits(req, state.settings)
    if req.logprobs:
        raise APIError(400, "logprobs are not supported by this server", param="logprobs")
    return state


def _check_model_and_engine(state: ServerState, req: SamplingFields) -> None:
    if req.model != state.settings.model_name:
        raise APIError(404, f"model '{req.model}' does not exist; this server serves "
                       f"'{state.settings.model_name}'", param="model", code="model_not_found")
    if not state.engine.healthy:
        raise as_api_error(state.engine_unavailable())


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    card = {"id": state.settings.model_name, "object": "model", "created": state.created, "owned_by": "moe-serve",
            "max_model_len": state.engine.max_model_len or None}
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = _checked_state(request, body)
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    tokenizer = state.engine.tokenizer
    try:
        prompts = body.prompts()
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    fmt = ResponseFormat(chat=False, model=state.settings.model_name)
    jobs, echoes = [], []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
            if not prompt:
                raise APIError(400, "prompt must not be empty", param="prompt")
        else:
            ids = list(prompt)
            check_prompt_ids(ids, len(tokenizer))
        max_tokens = resolve_max_tokens(body.max_tokens, 16, len(ids), state.engine.max_model_len,
                                        state.settings, param="max_tokens", prompt_param="prompt")
        params = sampling_params(body, max_tokens, stream=True)
        jobs.append(PromptJob(f"{fmt.id}-{i}", ids, params))
        echoes.append((prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else "")
    return await _serve(state, request, body, fmt, jobs, [e for e in echoes for _ in range(body.n)])


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = _checked_state(request, body)
    tokenizer = state.engine.tokenizer
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - template errors are the client's (e.g. role order)
        raise APIError(400, f"messages could not be rendered by the chat template: {exc}",
                       param="messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), None, len(ids), state.engine.max_model_len,
                                    state.settings, param=param, prompt_param="messages")
    fmt = ResponseFormat(chat=True, model=state.settings.model_name)
    job = PromptJob(f"{fmt.id}-0", ids, sampling_params(body, max_tokens, stream=True))
    return await _serve(state, request, body, fmt, [job], [""] * body.n)


async def _serve(state: ServerState, request: Request, body: SamplingFields, fmt: ResponseFormat,
                 jobs: list[PromptJob], echoes: list[str]) -> Response:
    """Admit, run and answer (stream or JSON) one validated request."""
    prompt_tokens = sum(len(job.prompt_ids) for job in jobs)
    observer = (state.warmup_metrics if is_warmup(request) else state.metrics).start(prompt_tokens)
    try:
        ticket = await until_disconnect(request, state.admission.acquire(prompt_tokens))
    except BaseException as exc:
        observer.finish(status_for_http(exc.status) if isinstance(exc, APIError) else "aborted")
        raise
    observer.admitted()
    deltas = generate_deltas(state.engine, jobs, body.n, observer)

    async def close(status: str) -> None:
        await deltas.aclose()
        ticket.release()
        observer.finish(status)

    timeout = state.settings.request_timeout_s
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    try:
        if body.stream:  # wait for the first token here, so early errors get a real HTTP status
            first = await until_disconnect(request, _next_before(deltas, deadline))
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _sse(fmt, first, deltas, observer, include_usage, echoes, deadline)
            return SSEResponse(stream, on_close=lambda: close("aborted"))
        texts, reasons = await until_disconnect(request, _collect(deltas, len(echoes), deadline))
    except ClientGone:
        await close("aborted")
        return Response(status_code=499)
    except APIError as exc:
        await close("client_error" if exc.status < 500 else "server_error")
        raise
    except BaseException:
        await close("server_error")
        raise
    await close("ok")
    texts = [echo + text for echo, text in zip(echoes, texts)]
    return JSONResponse(fmt.full(texts, reasons, observer.prompt_tokens, observer.generation_tokens))


async def _next_before(deltas: AsyncIterator[Delta], deadline: float | None) -> Delta | None:
    """The next delta (None at the end); 408 if the request's deadline passes first."""
    if deadline is None:
        return await anext(deltas, None)
    try:  # not asyncio.wait_for: on 3.11 it can swallow a cancellation (client disconnect)
        async with asyncio.timeout_at(deadline):
            return await anext(deltas, None)
    except TimeoutError:
        raise APIError(408, "the request took longer than the server's request timeout", code="timeout") from None


async def _collect(deltas: AsyncIterator[Delta], choices: int,
                   deadline: float | None) -> tuple[list[str], list[str | None]]:
    texts: list[list[str]] = [[] for _ in range(choices)]
    reasons: list[str | None] = [None] * choices
    while (d := await _next_before(deltas, deadline)) is not None:
        texts[d.choice].append(d.text)
        if d.finish_reason is not None:
            reasons[d.choice] = d.finish_reason
    return ["".join(t) for t in texts], reasons


async def _sse(fmt: ResponseFormat, first: Delta | None, deltas: AsyncIterator[Delta], observer: RequestObserver,
               include_usage: bool, echoes: list[str], deadline: float | None) -> AsyncIterator[str]:
    """The event stream; an error after the first event becomes a final error event."""
    try:
        if any(echoes):
            for choice, echo in enumerate(echoes):
                yield sse_event(fmt.chunk(choice, echo, None))
        if first is not None:
            yield sse_event(fmt.chunk(first.choice, first.text, first.finish_reason))
            while (d := await _next_before(deltas, deadline)) is not None:
                yield sse_event(fmt.chunk(d.choice, d.text, d.finish_reason))
        if include_usage:
            yield sse_event(fmt.usage_chunk(observer.prompt_tokens, observer.generation_tokens))
        observer.finish("ok")
    except APIError as exc:
        observer.finish("client_error" if exc.status < 500 else "server_error")
        yield sse_error_event(exc)
    except Exception as exc:  # noqa: BLE001 - reported in-stream, never as a traceback
        observer.finish("server_error")
        yield sse_error_event(as_api_error(exc))
    yield DONE_EVENT
