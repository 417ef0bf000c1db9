"""The API process's side of the structured-output checker (service.grammar_worker).

One checker process per server: started with the app (importing xgrammar takes seconds and runs
while the engine loads), given the served model's vocabulary (and the engine's whitespace and
cache settings) once the engine is up, then asked to check each constraint the server has not
seen before. A check has two halves: the screen (conversion, rules that can never finish), which
`check()` waits for, and the compile, which it hands back as a `Verdict` for the request to race
against the engine's own compile (service.request_flow): whichever ends first decides, so an
accepted constraint costs the screen only. After a compile over budget, checks wait for their
whole verdict (the engine sees nothing first) for SERIAL_AFTER_REFUSAL_S: a stream of slow
constraints gets at most one compile into the engine per such window. Verdicts are cached by content, so
a schema sent again costs nothing, a rejected one is rejected at once. Until the checker answers
(start, restart after a crash) a check is a 503 with Retry-After; a caller that goes away cancels
its check (the checker kills the compile). Beyond MAX_WAITING checks in flight: 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from service.errors import APIError

logger = logging.getLogger(__name__)
CACHE_ENTRIES = 4096
MAX_WAITING = 64
RESPAWN_DELAY_S = 2.0
CLOSE_TIMEOUT_S = 5.0
SERIAL_AFTER_REFUSAL_S = 60.0


class CheckFailed(Exception):
    """A constraint was refused: spec `index` of the checked list, and why (None: over budget)."""

    def __init__(self, index: int | None, reason: str | None) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


def tokenizer_info_json(tokenizer: Any, vocab_size: int) -> str | None:
    """xgrammar's TokenizerInfo of the served model as vLLM's xgrammar backend builds it for
    Hugging Face tokenizers, serialised; None where xgrammar cannot read the tokenizer."""
    try:
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size).serialize_json()
    except Exception:  # noqa: BLE001 - e.g. a Mistral tokenizer: the checker uses a byte vocabulary
        logger.warning("xgrammar cannot read this tokenizer; structured-output compile times are measured "
                       "against a byte vocabulary", exc_info=True)
        return None


class Verdict:
    """The compile half of one check: `wait()` returns once the constraints compiled within the
    budget and raises CheckFailed when not; `cancel()` stops the compile (the engine's was first)."""

    def __init__(self, final: asyncio.Future | None = None, cancel: Any = None) -> None:
        self._final, self._cancel = final, cancel

    async def wait(self) -> None:
        if self._final is None:
            return
        answer = await asyncio.shield(self._final)
        if not answer["ok"]:
            raise CheckFailed(answer.get("index"), answer.get("error"))

    def cancel(self) -> None:
        if self._final is not None and not self._final.done():
            self._cancel()


class GrammarChecker:
    """`check(specs)` returns a Verdict once every (kind, text) spec converts and can finish;
    raises CheckFailed otherwise, APIError 429/503 when it cannot check now. The Verdict says
    whether they compile within `budget_s` of CPU time."""

    def __init__(self, budget_s: float, max_parallel: int) -> None:
        self.budget_s = budget_s
        self.max_parallel = max_parallel
        self._info_path: Path | None = None
        self._config: dict[str, Any] = {}
        self._configured = False
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, tuple[asyncio.Future, asyncio.Future]] = {}  # id -> (screened, final)
        self._next_id = 0
        self._cache: OrderedDict[str, tuple[int | None, str | None] | None] = OrderedDict()
        self._serial_until = 0.0
        self.closed = False

    async def spawn(self) -> None:
        """Start the checker process (it imports xgrammar, then waits for `configure`)."""
        self._ready = asyncio.get_running_loop().create_future()
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service.grammar_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 20)
        self._reader = asyncio.create_task(self._read(self._proc, self._ready))
        if self._configured:
            self._send_config()

    def _send_config(self) -> None:
        config = {"tokenizer_info": str(self._info_path) if self._info_path else None,
                  "max_parallel": self.max_parallel, **self._config}
        self._proc.stdin.write((json.dumps(config) + "\n").encode())

    async def configure(self, info_json: str | None, any_whitespace: bool = True, cache_limit_bytes: int = 512 << 20,
                        timeout_s: float = 300.0) -> None:
        """Hand the checker the model's vocabulary (through a temp file of its own, removed by
        close) and the engine's xgrammar settings (whitespace in JSON, cache size), and wait until
        it answers checks."""
        self._config = {"any_whitespace": any_whitespace, "cache_limit_bytes": cache_limit_bytes}
        if info_json is not None:
            fd, name = tempfile.mkstemp(prefix="moe-serve-xgrammar-", suffix=".json")
            os.close(fd)
            self._info_path = Path(name)
            await asyncio.to_thread(self._info_path.write_text, info_json, "utf-8")
        self._configured = True
        self._send_config()
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        logger.info("structured-output checker ready (compile budget %.1f s, %d at once)", self.budget_s,
                    self.max_parallel)

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
            elif message.get("screened"):
                if (futures := self._pending.get(message["id"])) is not None and not futures[0].done():
                    futures[0].set_result(True)
            elif (futures := self._pending.pop(message["id"], None)) is not None:
                for future in futures:
                    if not future.done():
                        future.set_result(message)
        await proc.wait()
        gone = APIError(503, "the structured-output checker restarted; retry", code="checker_restarting",
                        headers={"Retry-After": "1"})
        for future in (f for futures in self._pending.values() for f in futures):
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

    async def check(self, specs: list[tuple[str, str]]) -> Verdict:
        key = self._key(specs)
        if key in self._cache:
            self._cache.move_to_end(key)
            verdict = self._cache[key]
            if verdict is not None:
                raise CheckFailed(*verdict)
            return Verdict()
        if len(self._pending) >= MAX_WAITING:
            raise APIError(429, "server is at capacity (structured-output checks); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if self._ready is None or not self._ready.done() or self._ready.exception() is not None:
            raise APIError(503, "structured-output checks are not available yet; retry shortly",
                           code="checker_starting", headers={"Retry-After": "5"})
        check_id, self._next_id = self._next_id, self._next_id + 1
        loop = asyncio.get_running_loop()
        screened, final = loop.create_future(), loop.create_future()
        self._pending[check_id] = (screened, final)
        final.add_done_callback(lambda done: self._record(key, done))
        self._proc.stdin.write((json.dumps({"id": check_id, "specs": specs, "budget_s": self.budget_s})
                                + "\n").encode())
        verdict = Verdict(final, lambda: self._cancel(check_id))
        try:
            if loop.time() < self._serial_until:
                await verdict.wait()  # after a refusal: nothing reaches the engine unchecked for a while
            elif not await screened:  # the check ended in its screen
                await verdict.wait()
        except asyncio.CancelledError:  # the client went away: stop its compile
            verdict.cancel()
            raise
        return verdict

    def _cancel(self, check_id: int) -> None:
        """Kill a check's child (its request no longer needs the verdict)."""
        futures = self._pending.pop(check_id, None)
        for future in futures or ():
            future.cancel()
        with contextlib.suppress(ConnectionError, RuntimeError, AttributeError):
            self._proc.stdin.write((json.dumps({"cancel": check_id}) + "\n").encode())

    def _record(self, key: str, final: asyncio.Future) -> None:
        """Cache a finished check's verdict; after a compile over budget, check serially for a while."""
        if final.cancelled() or final.exception() is not None:
            return
        answer = final.result()
        verdict = None if answer["ok"] else (answer.get("index"), answer.get("error"))
        self._cache[key] = verdict
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        if verdict is not None and verdict[1] is None:
            self._serial_until = asyncio.get_running_loop().time() + SERIAL_AFTER_REFUSAL_S

    async def close(self) -> None:
        """Stop the checker process: end of its input (it kills its compiles and exits), else a kill."""
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
        if self._info_path is not None:
            self._info_path.unlink(missing_ok=True)
