"""service/memory_trim.py: the periodic malloc_trim task (fast, no server)."""

from __future__ import annotations

import asyncio
import platform

import pytest

from moe_serve.service.memory_trim import find_malloc_trim, trim_periodically


def test_trims_every_interval_until_cancelled() -> None:
    calls: list[int] = []

    async def scenario() -> None:
        task = asyncio.create_task(trim_periodically(0.01, lambda pad: calls.append(pad) or 1))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        settled = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == settled  # nothing after cancel

    asyncio.run(scenario())
    assert len(calls) >= 3 and set(calls) == {0}


def test_zero_interval_returns_without_trimming() -> None:
    calls: list[int] = []
    asyncio.run(asyncio.wait_for(trim_periodically(0, calls.append), timeout=1))
    assert calls == []


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_malloc_trim_is_found_and_runs() -> None:
    trim = find_malloc_trim()
    assert trim is not None and trim(0) in (0, 1)
