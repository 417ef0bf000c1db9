"""Admission control: bounded concurrency in slots, a bounded wait queue, a prompt-token budget.

A request takes one slot per engine sequence it will start (prompts x n) before anything is
tokenized; beyond `max_running` slots it waits in a bounded queue, beyond that it is answered
429 with `Retry-After` at once. The prompt-token budget is charged per engine request once its
prompt is tokenized (`charge`), and waits while other prompts hold the budget.
"""

from __future__ import annotations

import asyncio
from collections import deque

from moe_serve.service.errors import APIError


class Ticket:
    """One admitted request holding `slots`; `release()` is idempotent."""

    def __init__(self, admission: "Admission", slots: int) -> None:
        self._admission = admission
        self.slots = slots
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release_slots(self.slots)


class TokenCharge:
    """Prompt tokens of one engine request held against the budget; `release()` is idempotent."""

    def __init__(self, admission: "Admission", tokens: int) -> None:
        self._admission = admission
        self.tokens = tokens

    def release(self) -> None:
        if self.tokens:
            tokens, self.tokens = self.tokens, 0
            self._admission._release_tokens(tokens)


class Admission:
    """`acquire(slots)` admits (maybe after waiting in the queue) or raises 429."""

    def __init__(self, max_running: int, max_queued: int, max_prompt_tokens: int | None,
                 retry_after_s: int = 1) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_prompt_tokens = max_prompt_tokens
        self.retry_after_s = retry_after_s
        self.running = 0  # slots held by admitted requests
        self.prompt_tokens = 0  # tokens charged by running engine requests
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()
        self._token_waiters: list[asyncio.Future] = []
        self.closed = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _reject(self, why: str) -> APIError:
        return APIError(429, f"server is at capacity ({why}); retry later", code="rate_limit_exceeded",
                        headers={"Retry-After": str(self.retry_after_s)})

    def _fits(self, slots: int) -> bool:
        return self.running == 0 or self.running + slots <= self.max_running

    def admit_now(self, slots: int = 1) -> Ticket | None:
        """A ticket for `slots` engine sequences if they fit now and nobody waits before them, else
        None (then `acquire` queues); 400 if more than the server can ever run at once, 503 once
        shutting down."""
        if self.closed:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if slots > self.max_running:
            raise APIError(400, f"the request needs {slots} concurrent sequences (prompts x n); this server "
                           f"runs at most {self.max_running}", param="n", code="invalid_value")
        return self._admit(slots) if not self._waiters and self._fits(slots) else None

    async def acquire(self, slots: int = 1) -> Ticket:
        """A ticket for `slots` engine sequences, after waiting in the queue if need be (429 when
        the queue is full); errors as `admit_now`."""
        ticket = self.admit_now(slots)
        if ticket is not None:
            return ticket
        if len(self._waiters) >= self.max_queued:
            raise self._reject(f"{self.running} running, {len(self._waiters)} queued")
        waiter = asyncio.get_running_loop().create_future()
        entry = (waiter, slots)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif waiter.done() and not waiter.cancelled():
                waiter.result().release()  # admitted just as we were cancelled
            raise
        return waiter.result()

    def _admit(self, slots: int) -> Ticket:
        self.running += slots
        return Ticket(self, slots)

    def _release_slots(self, slots: int) -> None:
        self.running -= slots
        while self._waiters and self._fits(self._waiters[0][1]):
            waiter, wanted = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(self._admit(wanted))

    async def charge(self, tokens: int) -> TokenCharge:
        """Hold `tokens` prompt tokens of one engine request; waits while the budget is taken."""
        budget = self.max_prompt_tokens
        if budget is not None and tokens > budget:
            raise APIError(400, f"prompt has {tokens} tokens, more than the server's in-flight budget of "
                           f"{budget}", param="prompt", code="context_length_exceeded")
        while budget is not None and self.prompt_tokens and self.prompt_tokens + tokens > budget:
            waiter = asyncio.get_running_loop().create_future()
            self._token_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._token_waiters:
                    self._token_waiters.remove(waiter)
        self.prompt_tokens += tokens
        return TokenCharge(self, tokens)

    def _release_tokens(self, tokens: int) -> None:
        self.prompt_tokens -= tokens
        waiters, self._token_waiters = self._token_waiters, []
        for waiter in waiters:  # each re-checks the budget
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        """Refuse new requests and fail every waiter (graceful shutdown)."""
        self.closed = True
        while self._waiters:
            waiter, _ = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(APIError(503, "server is shutting down", code="shutting_down"))
