"""The API process's side of the structured-output checker (moe_serve.service.grammar_worker).

One checker process per server: started with the app (importing xgrammar takes seconds and runs
while the engine loads), given the engine's JSON whitespace setting once the engine is up, then
asked to check each constraint the server has not seen before: converted as vLLM's xgrammar
backend converts it, with no rule that can never finish, within a budget of CPU seconds (the
same verdict on an idle machine and a loaded one). The check decides before the engine sees the
request; compiling for the vocabulary is the engine's own, awaited within the request's timeout.
Verdicts are cached by content, so a schema sent again costs nothing, a rejected one is rejected
at once. Until the checker answers (start, restart after a crash) a check is a 503 with
Retry-After; a caller that goes away cancels its check (the checker kills its child). Beyond
MAX_WAITING checks in flight: 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import sys
from collections import OrderedDict

from moe_serve.service.errors import APIError

logger = logging.getLogger(__name__)
CACHE_ENTRIES = 4096
MAX_WAITING = 64
RESPAWN_DELAY_S = 2.0
CLOSE_TIMEOUT_S = 5.0


class CheckFailed(Exception):
    """A constraint was refused: spec `index` of the checked list, and why (None: over budget)."""

    def __init__(self, index: int | None, reason: str | None) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


class GrammarChecker:
    """`check(specs)` returns once every (kind, text) spec converts within `budget_s` of CPU time
    and can finish; raises CheckFailed otherwise, APIError 429/503 when it cannot check now."""

    def __init__(self, budget_s: float, max_parallel: int) -> None:
        self.budget_s = budget_s
        self.max_parallel = max_parallel
        self._any_whitespace = True
        self._configured = False
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}  # check id -> its answer
        self._next_id = 0
        self._cache: OrderedDict[str, tuple[int | None, str | None] | None] = OrderedDict()
        self.closed = False

    async def spawn(self) -> None:
        """Start the checker process (it imports xgrammar, then waits for `configure`)."""
        self._ready = asyncio.get_running_loop().create_future()
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moe_serve.service.grammar_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 20)
        self._reader = asyncio.create_task(self._read(self._proc, self._ready))
        if self._configured:
            self._send_config()

    def _send_config(self) -> None:
        config = {"max_parallel": self.max_parallel, "any_whitespace": self._any_whitespace}
        self._proc.stdin.write((json.dumps(config) + "\n").encode())

    async def configure(self, any_whitespace: bool = True, timeout_s: float = 300.0) -> None:
        """Hand the checker the engine's xgrammar setting (whitespace in JSON) and wait until it
        answers checks."""
        self._any_whitespace = any_whitespace
        self._configured = True
        self._send_config()
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        logger.info("structured-output checker ready (conversion budget %.1f s of CPU, %d at once)",
                    self.budget_s, self.max_parallel)

    async def _read(self, proc: asyncio.subprocess.Process, ready: asyncio.Future) -> None:
        """Answers from the checker; when it exits, fail what waits and start a new one."""
        while line := await proc.stdout.readline():
            try:
                message = json.loads(line)
            except ValueError:
                logger.error("structured-output checker wrote %r", line[:200])
                continue
            if message.get("ready"):
                ready.set_result(None)
            elif (future := self._pending.pop(message["id"], None)) is not None and not future.done():
                future.set_result(message)
        await proc.wait()
        gone = APIError(503, "the structured-output checker restarted; retry", code="checker_restarting",
                        headers={"Retry-After": "1"})
        for future in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        if not ready.done():
            ready.set_exception(gone)
        if not self.closed:
            logger.error("structured-output checker exited with %s; starting a new one", proc.returncode)
            await asyncio.sleep(RESPAWN_DELAY_S)
            await self.spawn()

    @staticmethod
    def _key(specs: list[tuple[str, str]]) -> str:
        return hashlib.sha256(json.dumps(specs).encode()).hexdigest()

    async def check(self, specs: list[tuple[str, str]]) -> None:
        key = self._key(specs)
        if key in self._cache:
            self._cache.move_to_end(key)
            verdict = self._cache[key]
            if verdict is not None:
                raise CheckFailed(*verdict)
            return
        if len(self._pending) >= MAX_WAITING:
            raise APIError(429, "server is at capacity (structured-output checks); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if self._ready is None or not self._ready.done() or self._ready.exception() is not None:
            raise APIError(503, "structured-output checks are not available yet; retry shortly",
                           code="checker_starting", headers={"Retry-After": "5"})
        check_id, self._next_id = self._next_id, self._next_id + 1
        answer = asyncio.get_running_loop().create_future()
        self._pending[check_id] = answer
        answer.add_done_callback(lambda done: self._record(key, done))
        self._proc.stdin.write((json.dumps({"id": check_id, "specs": specs, "budget_s": self.budget_s})
                                + "\n").encode())
        try:
            message = await asyncio.shield(answer)
        except asyncio.CancelledError:  # the client went away: stop its check
            self._cancel(check_id)
            raise
        if not message["ok"]:
            raise CheckFailed(message.get("index"), message.get("error"))

    def _cancel(self, check_id: int) -> None:
        """Kill a check's child (its request no longer needs the verdict)."""
        future = self._pending.pop(check_id, None)
        if future is not None:
            future.cancel()
        with contextlib.suppress(ConnectionError, RuntimeError, AttributeError):
            self._proc.stdin.write((json.dumps({"cancel": check_id}) + "\n").encode())

    def _record(self, key: str, answer: asyncio.Future) -> None:
        """Cache a finished check's verdict."""
        if answer.cancelled() or answer.exception() is not None:
            return
        message = answer.result()
        self._cache[key] = None if message["ok"] else (message.get("index"), message.get("error"))
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    async def close(self) -> None:
        """Stop the checker process: end of its input (it kills its children and exits), else a kill."""
        self.closed = True
        if self._proc is not None and self._proc.returncode is None:
            self._proc.stdin.close()
            try:
                await asyncio.wait_for(self._proc.wait(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
