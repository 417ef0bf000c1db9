"""Run one HTTP request's prompts through the engine and merge their output streams.

A request has one or more prompts (completions accept a batch), each with `n` choices;
choice index = prompt_index * n + completion_index. Output is consumed as DELTA
`RequestOutput`s so TTFT and inter-token latency are observed for every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from service.engine import EngineClientError, EngineDead, EngineHandle, EngineNotReady
from service.errors import APIError
from service.metrics import RequestObserver


@dataclass
class Delta:
    """New text of one choice; `finish_reason` is set on the choice's last delta only."""

    choice: int
    text: str
    num_tokens: int
    finish_reason: str | None


@dataclass
class PromptJob:
    request_id: str
    prompt_ids: list[int]
    params: Any  # vllm.SamplingParams


def as_api_error(exc: BaseException) -> APIError:
    """Map engine-side failures to HTTP errors (400 bad request, 503 unavailable, 500 otherwise)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineClientError):
        return APIError(400, str(exc) or "invalid request", code="invalid_value")
    if isinstance(exc, EngineNotReady):
        return APIError(503, "the engine is still starting; retry shortly", code="engine_starting",
                        headers={"Retry-After": "5"})
    if isinstance(exc, EngineDead):
        return APIError(503, "the engine has stopped; the server is shutting down", code="engine_dead")
    return APIError(500, "internal error while generating", code="internal_error")


def _raise_if_aborted(finish_reason: str | None) -> None:
    """Only the server aborts live requests (shutdown drain timeout): tell the client so."""
    if finish_reason == "abort":
        raise APIError(503, "request aborted: the server is shutting down", code="shutting_down")


async def _one_prompt(engine: EngineHandle, index: int, job: PromptJob, n: int,
                      queue: asyncio.Queue) -> None:
    try:
        async for out in engine.generate(job.prompt_ids, job.params, job.request_id):
            for o in out.outputs:
                await queue.put(Delta(index * n + o.index, o.text, len(o.token_ids), o.finish_reason))
    except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
        await queue.put(exc)
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        await queue.put(None)


async def generate_deltas(engine: EngineHandle, jobs: list[PromptJob], n: int,
                          observer: RequestObserver) -> AsyncIterator[Delta]:
    """Yield deltas of all jobs as they arrive; closing early aborts every engine request."""
    if len(jobs) == 1:  # fast path: no tasks, no queue
        job = jobs[0]
        try:
            async for out in engine.generate(job.prompt_ids, job.params, job.request_id):
                for o in out.outputs:
                    observer.on_tokens(o.index, len(o.token_ids), o.finish_reason)
                    _raise_if_aborted(o.finish_reason)
                    yield Delta(o.index, o.text, len(o.token_ids), o.finish_reason)
        except (EngineClientError, EngineNotReady, EngineDead) as exc:
            raise as_api_error(exc) from exc
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_one_prompt(engine, i, job, n, queue)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise as_api_error(item) from item
            else:
                observer.on_tokens(item.choice, item.num_tokens, item.finish_reason)
                _raise_if_aborted(item.finish_reason)
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
