"""One generation request around vLLM's handler: admission, deadline, disconnect, metrics, errors.

`serve()` takes admission slots (or 429) before anything is tokenized, then runs the vLLM handler
call (which renders and tokenizes off the event loop, then starts engine requests through
`ObservedEngineClient`) as a task bound to this request's `RequestContext`. The handler's answer
becomes: a JSON body; an SSE stream; or an error object in our format. A stream's response starts
once the engine has accepted every engine request the handler began (input processed, admitted,
sent to the engine core), so the first token goes out as soon as it exists, as under `vllm serve`,
while the request's own faults (and a timeout or shutdown before that) still get their HTTP
status; without engine requests to wait for, it starts at the stream's first event. After the
start, a failure or a timeout is a final error event. A disconnect aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moe_serve.service import vllm_compat as compat
from moe_serve.service.engine_client import CURRENT, RequestContext
from moe_serve.service.errors import APIError, from_vllm_error, sse_error_event
from moe_serve.service.metrics import CLIENT_CLOSED, COUNTED, status_for_http
from moe_serve.service.rejection_log import RejectionLog
from moe_serve.service.state import ServerState
from moe_serve.service.streaming import DONE_EVENT, ClientGone, SSEResponse, StreamDeadline, until_disconnect
from moe_serve.service.warmup import is_warmup

logger = logging.getLogger(__name__)
rejected = RejectionLog(logger)  # bounded lines, at most one a second: never the client's values
_ERROR_EVENT = 'data: {"error"'


def _status(err: APIError) -> str:
    return status_for_http(err.status)


def api_error_from_exception(exc: BaseException) -> APIError:
    """An exception from vLLM's handler, classified as `vllm serve` does (its request checks raise
    ValueError/TypeError/template errors: 4xx); whatever it calls a server error is a logged 500.
    Engine-side failures arrive as APIError already (moe_serve.service.engine_client)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, NotImplementedError):  # e.g. a feature this model lacks: the client's request
        return APIError(400, str(exc) or "not supported", code="not_supported")
    err = from_vllm_error(compat.error_response_for(exc).error.model_dump())
    if err.status >= 500:
        logger.error("request failed", exc_info=exc)
    else:
        rejected("request rejected", err, exc)
    return err


def _event_error(event: str) -> APIError:
    try:
        error = json.loads(event[len("data: "):])["error"]
    except (ValueError, KeyError, TypeError):
        error = {"code": 500}
    return from_vllm_error(error)


async def _finished(work: asyncio.Future) -> Any:
    """`work`'s result; when this wait is cancelled (disconnect, deadline), `work` is too (its engine
    requests aborted) and has ended before this returns."""
    try:
        return await work
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)


class _Outcome:
    status = "aborted"  # until the stream ends by itself


async def serve(request: Request, state: ServerState, slots: int, call: Callable[[], Awaitable[Any]]) -> Response:
    """Admit `slots`, run `call()` (a vLLM handler coroutine) and answer."""
    observer = (state.warmup_metrics if is_warmup(request) else state.metrics).start(0)
    request.scope[COUNTED] = True
    try:  # admitted at once unless others wait or the slots are taken: then queued, watching the client
        ticket = state.admission.admit_now(slots) or await until_disconnect(request, state.admission.acquire(slots))
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
        result = await until_disconnect(request, _finished(work), deadline)
        if isinstance(result, compat.ErrorResponse):
            raise ctx.error or from_vllm_error(result.error.model_dump())
        if isinstance(result, AsyncIterator):
            return await _stream_response(request, _Events(result, ctx, deadline), ctx, close)
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


class _Events:
    """A handler's SSE stream whose first event a task of its own fetches (iterating the stream is
    what starts its engine requests); `close()` ends both, whoever calls it first."""

    def __init__(self, events: AsyncIterator[str], ctx: RequestContext, deadline: float | None) -> None:
        self.events = events
        self.deadline = StreamDeadline(deadline)
        token = CURRENT.set(ctx)  # engine requests begun while iterating find their request
        try:
            self.first: asyncio.Future[str | None] = asyncio.ensure_future(self.deadline.next(events))
        finally:
            CURRENT.reset(token)

    async def next(self) -> str | None:
        """The event after the first (None at the end); 408 once the request's deadline passes."""
        return await self.deadline.next(self.events)

    async def close(self) -> None:
        self.first.cancel()
        await asyncio.gather(self.first, return_exceptions=True)  # its result or error is nobody's now
        self.deadline.close()
        await self.events.aclose()


async def _accepted_before_first_event(events: _Events, ctx: RequestContext) -> bool:
    """True once the engine has accepted every engine request begun so far (there were some),
    False when the stream's first event (or its failure) came first."""
    waiters = {events.first}
    if ctx.engine_requests:
        waiters.add(asyncio.ensure_future(ctx.all_accepted.wait()))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters - {events.first}:
            waiter.cancel()
    return not events.first.done()


async def _stream_response(request: Request, events: _Events, ctx: RequestContext,
                           close: Callable[[str], None]) -> Response:
    """The SSE response, once the engine has accepted the request or the first event is there; a
    failure before then raises (its HTTP status; the first event's wait carries the deadline:
    408), after it ends the stream with an error event."""
    try:
        accepted = await until_disconnect(request, _accepted_before_first_event(events, ctx))
        if not accepted:
            first = events.first.result()
            if first is None or first.startswith(_ERROR_EVENT):
                raise ctx.error or (_event_error(first) if first else APIError(500, "empty stream"))
    except BaseException:
        with anyio.CancelScope(shield=True):
            await events.close()
        raise
    outcome = _Outcome()

    async def on_close() -> None:
        await events.close()  # the body may never have started (client gone first)
        close(outcome.status)

    return SSEResponse(_sse(events, ctx, outcome), on_close=on_close)


async def _sse(events: _Events, ctx: RequestContext, outcome: _Outcome) -> AsyncIterator[str]:
    """vLLM's events, passed through; an error event (vLLM's, a failure or a timeout) in our
    format, then [DONE]."""
    try:
        event = await events.first
        if event is None:
            raise APIError(500, "empty stream")
        while event is not None:
            if event.startswith(_ERROR_EVENT):
                raise ctx.error or _event_error(event)
            yield event
            event = await events.next()
        outcome.status = "ok"
        return
    except APIError as exc:
        err = ctx.error or exc
    except Exception as exc:  # noqa: BLE001 - reported in-stream, never as a traceback
        err = ctx.error or api_error_from_exception(exc)
    finally:
        await events.close()
    outcome.status = _status(err)
    rejected("stream ends with an error", err)
    yield sse_error_event(err)
    yield DONE_EVENT
