"""The per-request deadline (`--request-timeout`, default 600 s) around each wait for a stream's
next event: it turns into a 408 when it passes, it never swallows a cancellation (client
disconnect), and a whole stream runs on one timer.

Python 3.11's asyncio.wait_for returns the inner result when its task is cancelled in the same
loop iteration as the inner awaitable completes; a disconnected request then kept generating to
its end (seen in test_disconnect once the default timeout put every request on that path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from moe_serve.service.errors import APIError
from moe_serve.service.streaming import StreamDeadline


async def _gated(gate: asyncio.Future) -> AsyncIterator[str]:
    yield await gate
    await asyncio.sleep(3600)
    yield "never"


def test_a_cancellation_that_meets_a_ready_delta_is_not_swallowed() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        deltas = _gated(gate)
        consumer = asyncio.create_task(StreamDeadline(loop.time() + 60).next(deltas))
        for _ in range(3):  # the consumer now waits for the delta
            await asyncio.sleep(0)
        gate.set_result("delta")  # the delta is ready ...
        consumer.cancel()  # ... in the same iteration as the client goes away
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await deltas.aclose()

    asyncio.run(scenario())


def test_a_passed_deadline_is_a_408_and_none_means_no_deadline() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        with pytest.raises(APIError) as exc:
            await StreamDeadline(loop.time() + 0.05).next(_gated(gate))
        assert exc.value.status == 408 and exc.value.code == "timeout"
        gate2 = loop.create_future()
        loop.call_later(0.1, gate2.set_result, "late but fine")
        assert await StreamDeadline(None).next(_gated(gate2)) == "late but fine"

    asyncio.run(scenario())


def test_a_stream_waits_on_one_timer_and_a_stall_after_many_events_is_a_408() -> None:
    async def events(n: int) -> AsyncIterator[int]:
        for i in range(n):
            await asyncio.sleep(0)
            yield i
        await asyncio.sleep(3600)  # the engine stalls
        yield -1

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        timers = []
        call_at = loop.call_at
        loop.call_at = lambda when, cb, *args, **kw: (timers.append(when) if getattr(cb, "__self__", None) is deadline
                                                      else None) or call_at(when, cb, *args, **kw)
        deadline, stream = StreamDeadline(loop.time() + 0.3), events(200)
        assert [await deadline.next(stream) for _ in range(200)] == list(range(200))
        with pytest.raises(APIError) as exc:
            await deadline.next(stream)
        assert exc.value.status == 408 and asyncio.current_task().cancelling() == 0
        assert len(timers) == 1  # the deadline's: not one per event
        with pytest.raises(APIError):  # after the deadline: at once
            await deadline.next(stream)
        deadline.close()
        await stream.aclose()

    asyncio.run(scenario())


def test_a_client_disconnect_during_a_wait_is_a_cancellation_not_a_408() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        deadline = StreamDeadline(loop.time() + 60)
        stream = _gated(loop.create_future())
        consumer = asyncio.create_task(deadline.next(stream))
        await asyncio.sleep(0.01)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        deadline.close()

    asyncio.run(scenario())
