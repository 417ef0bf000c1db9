"""The per-request deadline (`--request-timeout`, default 600 s) around each engine delta: it
turns into a 408 when it passes, and it never swallows a cancellation (client disconnect).

Python 3.11's asyncio.wait_for returns the inner result when its task is cancelled in the same
loop iteration as the inner awaitable completes; a disconnected request then kept generating to
its end (seen in test_disconnect once the default timeout put every request on that path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.errors import APIError
from service.streaming import next_before


async def _gated(gate: asyncio.Future) -> AsyncIterator[str]:
    yield await gate
    await asyncio.sleep(3600)
    yield "never"


def test_a_cancellation_that_meets_a_ready_delta_is_not_swallowed() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        deltas = _gated(gate)
        consumer = asyncio.create_task(next_before(deltas, loop.time() + 60))
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
            await next_before(_gated(gate), loop.time() + 0.05)
        assert exc.value.status == 408 and exc.value.code == "timeout"
        gate2 = loop.create_future()
        loop.call_later(0.1, gate2.set_result, "late but fine")
        assert await next_before(_gated(gate2), None) == "late but fine"

    asyncio.run(scenario())
