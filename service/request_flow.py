"""One generation request around vLLM's handler: admission, deadline, disconnect, metrics, errors.

`serve()` takes admission slots (or 429) before anything is tokenized, then runs the vLLM handler
call (which renders and tokenizes off the event loop, then starts engine requests through
`ObservedEngineClient`) as a task bound to this request's `RequestContext`. The handler's answer
becomes: a JSON body; an SSE stream (its first event is awaited here, so an early failure still
gets a real HTTP status); or an error object in our format. A request timeout gives 408 (or a
final stream error event), a disconnect aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from service import vllm_compat as compat
from service.engine_client import CURRENT, RequestContext
from service.errors import APIError, from_vllm_error, sse_error_event
from service.metrics import CLIENT_CLOSED, COUNTED, status_for_http
from service.state import ServerState
from service.streaming import DONE_EVENT, ClientGone, SSEResponse, next_before, until_disconnect
from service.warmup import is_warmup

logger = logging.getLogger(__name__)
_ERROR_EVENT = 'data: {"error"'


def _status(err: APIError) -> str:
    return status_for_http(err.status)


def api_error_from_exception(exc: BaseException) -> APIError:
    """An exception from vLLM's handler, classified as `vllm serve` does (its request checks raise
    ValueError/TypeError/template errors: 4xx); whatever it calls a server error is a logged 500.
    Engine-side failures arrive as APIError already (service.engine_client)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, NotImplementedError):  # e.g. a feature this model lacks: the client's request
        return APIError(400, str(exc) or "not supported", code="not_supported")
    err = from_vllm_error(compat.error_response_for(exc).error.model_dump())
    if err.status >= 500:
        logger.error("request failed", exc_info=exc)
    else:
        logger.info("request rejected: %s: %s", type(exc).__name__, exc)
    return err


def _event_error(event: str) -> APIError:
    try:
        error = json.loads(event[len("data: "):])["error"]
    except (ValueError, KeyError, TypeError):
        error = {"code": 500}
    return from_vllm_error(error)


class _Outcome:
    status = "aborted"  # until the stream ends by itself


async def serve(request: Request, state: ServerState, slots: int, call: Callable[[], Awaitable[Any]]) -> Response:
    """Admit `slots`, run `call()` (a vLLM handler coroutine) and answer."""
    observer = (state.warmup_metrics if is_warmup(request) else state.metrics).start(0)
    request.scope[COUNTED] = True
    try:
        ticket = await until_disconnect(request, state.admission.acquire(slots))
    except ClientGone:
        observer.finish("aborted")
        return Response(status_code=CLIENT_CLOSED)
    except APIError as exc:
        observer.finish(_status(exc))
        raise
    except BaseException:
        observer.finish("aborted")
        raise
    observer.admitted()
    ctx = RequestContext(observer, state.admission)
    timeout = state.settings.request_timeout_s
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

    def close(status: str) -> None:
        ticket.release()
        observer.finish(status)

    token = CURRENT.set(ctx)
    try:
        work = asyncio.ensure_future(call())  # the task copies this context: its engine requests find ctx
    finally:
        CURRENT.reset(token)
    try:
        result = await until_disconnect(request, work, deadline)
        if isinstance(result, compat.ErrorResponse):
            raise ctx.error or from_vllm_error(result.error.model_dump())
        if isinstance(result, AsyncIterator):
            first = await until_disconnect(request, next_before(result, deadline), deadline)
            if first is None or first.startswith(_ERROR_EVENT):
                await result.aclose()
                raise ctx.error or (_event_error(first) if first else APIError(500, "empty stream"))
            outcome = _Outcome()

            async def on_close() -> None:
                close(outcome.status)

            return SSEResponse(_events(first, result, ctx, deadline, outcome), on_close=on_close)
        body = result.model_dump()
    except ClientGone:
        close("aborted")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        err = ctx.error or api_error_from_exception(exc)
        close(_status(err))
        raise err from exc
    except BaseException:
        close("aborted")
        raise
    close("ok")
    return JSONResponse(body)


async def _events(first: str, rest: AsyncIterator[str], ctx: RequestContext, deadline: float | None,
                  outcome: _Outcome) -> AsyncIterator[str]:
    """vLLM's events, passed through; an error event (vLLM's, or a timeout) in our format, then [DONE]."""
    event: str | None = first
    try:
        while event is not None:
            if event.startswith(_ERROR_EVENT):
                logger.info("stream failed after it started: %s", event[:500].strip())
                raise ctx.error or _event_error(event)
            yield event
            event = await next_before(rest, deadline)
        outcome.status = "ok"
        return
    except APIError as exc:
        err = ctx.error or exc
    except Exception as exc:  # noqa: BLE001 - reported in-stream, never as a traceback
        err = ctx.error or api_error_from_exception(exc)
    finally:
        await rest.aclose()
    outcome.status = _status(err)
    logger.info("stream ends with error %d (%s): %s", err.status, err.code, err.message)
    yield sse_error_event(err)
    yield DONE_EVENT
