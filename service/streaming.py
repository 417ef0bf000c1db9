"""SSE framing, and racing work against a client disconnect."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from moe_serve.service.errors import APIError

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always closes its generator (so aborts run)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # cleanup must run even when the stream was cancelled
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._on_close()  # runs even if the stream never started (client gone)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T], deadline: float | None = None) -> T:
    """Await `work` as a task; if the client disconnects first raise ClientGone, if the loop time
    `deadline` passes first raise 408; either way the task is cancelled and awaited first."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    timeout = None if deadline is None else max(deadline - asyncio.get_running_loop().time(), 0.0)
    try:
        done, _ = await asyncio.wait({work_task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        watcher.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)  # its result (if it swallowed the cancel) is dropped
    if watcher in done:
        raise ClientGone()
    raise request_timeout()


def request_timeout() -> APIError:
    return APIError(408, "the request took longer than the server's request timeout", code="timeout")


class StreamDeadline:
    """A request's deadline (loop time `when`; None: none) over every wait for its stream's next
    item: `asyncio.timeout_at(when)` around each wait, with one timer for the whole stream instead
    of one per item. When the timer fires during a wait, the waiting task is cancelled as
    asyncio.timeout cancels it and the wait raises 408; a wait begun after `when` raises 408 at
    once; any other cancellation (client disconnect) passes through. `close()` drops the timer."""

    def __init__(self, when: float | None) -> None:
        self.when = when
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task | None = None  # the task waiting for an item now
        self._cancelling = 0                       # its cancel requests before this wait
        self._expiring = False                     # the timer cancelled the current wait

    def _expire(self) -> None:
        self._timer = None
        if self._waiter is not None:
            self._waiter.cancel()
            self._expiring = True

    async def next(self, stream: AsyncIterator[T]) -> T | None:
        """The stream's next item (None at its end); 408 if `when` passes first."""
        if self.when is None:
            return await anext(stream, None)
        loop = asyncio.get_running_loop()
        if loop.time() >= self.when:
            raise request_timeout()
        if self._timer is None:
            self._timer = loop.call_at(self.when, self._expire)
        task = asyncio.current_task()
        assert task is not None and self._waiter is None, "one wait at a time"
        self._waiter, self._cancelling, self._expiring = task, task.cancelling(), False
        try:
            return await anext(stream, None)
        except asyncio.CancelledError:
            if self._expiring and task.uncancel() <= self._cancelling:
                raise request_timeout() from None
            raise
        finally:
            self._waiter = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
