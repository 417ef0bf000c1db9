"""Admission control unit tests (pure asyncio, no engine)."""

from __future__ import annotations

import asyncio

import pytest

from moe_serve.service.admission import Admission
from moe_serve.service.errors import APIError


def run(coro):
    return asyncio.run(coro)


def test_admits_up_to_the_limit_then_queues_then_rejects_with_retry_after() -> None:
    async def scenario() -> None:
        adm = Admission(max_running=2, max_queued=1, max_prompt_tokens=None)
        a, b = await adm.acquire(1), await adm.acquire(1)
        waiting = asyncio.create_task(adm.acquire(1))
        await asyncio.sleep(0)
        assert adm.running == 2 and adm.queued == 1 and not waiting.done()
        with pytest.raises(APIError) as exc:
            await adm.acquire(1)
        assert exc.value.status == 429 and exc.value.headers["Retry-After"]
        a.release()
        c = await asyncio.wait_for(waiting, 1)
        assert adm.running == 2 and adm.queued == 0
        for t in (b, c, c):  # release is idempotent
            t.release()
        assert adm.running == 0 and adm.prompt_tokens == 0

    run(scenario())


def test_prompt_token_budget_holds_engine_requests_back_and_rejects_oversized_prompts() -> None:
    async def scenario() -> None:
        adm = Admission(max_running=10, max_queued=5, max_prompt_tokens=100)
        a = await adm.charge(80)
        waiting = asyncio.create_task(adm.charge(30))
        await asyncio.sleep(0)
        assert not waiting.done() and adm.prompt_tokens == 80
        with pytest.raises(APIError) as exc:
            await adm.charge(101)
        assert exc.value.status == 400 and exc.value.param == "prompt"
        a.release()
        b = await asyncio.wait_for(waiting, 1)
        assert adm.prompt_tokens == 30
        b.release()
        b.release()  # idempotent
        assert adm.prompt_tokens == 0

    run(scenario())


def test_a_batch_takes_one_slot_per_sequence_and_waits_for_all_of_them() -> None:
    async def scenario() -> None:
        adm = Admission(max_running=8, max_queued=4, max_prompt_tokens=None)
        small = await adm.acquire(3)
        batch = asyncio.create_task(adm.acquire(6))  # 3 + 6 > 8: waits for the slots
        await asyncio.sleep(0)
        assert adm.running == 3 and adm.queued == 1 and not batch.done()
        with pytest.raises(APIError) as exc:
            await adm.acquire(9)  # more than the server can ever run at once
        assert exc.value.status == 400
        small.release()
        big = await asyncio.wait_for(batch, 1)
        assert adm.running == 6
        big.release()
        assert adm.running == 0

    run(scenario())


def test_cancelled_waiter_leaves_no_slot_behind_and_close_fails_waiters() -> None:
    async def scenario() -> None:
        adm = Admission(max_running=1, max_queued=4, max_prompt_tokens=None)
        a = await adm.acquire(1)
        cancelled = asyncio.create_task(adm.acquire(1))
        closing = asyncio.create_task(adm.acquire(1))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert adm.queued == 1
        adm.close()
        with pytest.raises(APIError) as exc:
            await closing
        assert exc.value.status == 503
        with pytest.raises(APIError):
            await adm.acquire(1)
        a.release()
        assert adm.running == 0

    run(scenario())
