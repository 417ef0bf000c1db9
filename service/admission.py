"""Admission control: bounded concurrency, a bounded wait queue, a prompt-token budget.

Beyond the limits a request is answered 429 with `Retry-After` at once, so load turns
into fast rejections instead of an unbounded pile of waiting requests.
"""

from __future__ import annotations

import asyncio
from collections import deque

from service.errors import APIError


class Ticket:
    """One admitted request; `release()` is idempotent."""

    def __init__(self, admission: "Admission", prompt_tokens: int) -> None:
        self._admission = admission
        self.prompt_tokens = prompt_tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)


class Admission:
    """`acquire()` admits (maybe after waiting in the queue) or raises 429."""

    def __init__(self, max_running: int, max_queued: int, max_prompt_tokens: int | None,
                 retry_after_s: int = 1) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_prompt_tokens = max_prompt_tokens
        self.retry_after_s = retry_after_s
        self.running = 0
        self.prompt_tokens = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.closed = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _reject(self, why: str) -> APIError:
        return APIError(429, f"server is at capacity ({why}); retry later", code="rate_limit_exceeded",
                        headers={"Retry-After": str(self.retry_after_s)})

    def _fits(self, prompt_tokens: int) -> bool:
        if self.running >= self.max_running:
            return False
        budget = self.max_prompt_tokens
        return budget is None or self.running == 0 or self.prompt_tokens + prompt_tokens <= budget

    async def acquire(self, prompt_tokens: int) -> Ticket:
        if self.closed:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise APIError(400, f"prompt has {prompt_tokens} tokens, more than the server's in-flight budget of "
                           f"{self.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
        if not self._waiters and self._fits(prompt_tokens):
            return self._admit(prompt_tokens)
        if len(self._waiters) >= self.max_queued:
            raise self._reject(f"{self.running} running, {len(self._waiters)} queued")
        waiter = asyncio.get_running_loop().create_future()
        waiter.prompt_tokens = prompt_tokens  # type: ignore[attr-defined]
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                waiter.result().release()  # admitted just as we were cancelled
            raise
        return waiter.result()

    def _admit(self, prompt_tokens: int) -> Ticket:
        self.running += 1
        self.prompt_tokens += prompt_tokens
        return Ticket(self, prompt_tokens)

    def _release(self, ticket: Ticket) -> None:
        self.running -= 1
        self.prompt_tokens -= ticket.prompt_tokens
        while self._waiters and self._fits(self._waiters[0].prompt_tokens):  # type: ignore[attr-defined]
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(self._admit(waiter.prompt_tokens))  # type: ignore[attr-defined]

    def close(self) -> None:
        """Refuse new requests and fail every waiter (graceful shutdown)."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(APIError(503, "server is shutting down", code="shutting_down"))
