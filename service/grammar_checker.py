"""The API process's side of the structured-output checker (service.grammar_worker).

One checker process per server: started with the app (importing xgrammar takes seconds and runs
while the engine loads), given the served model's vocabulary once the engine is up, then asked
to check each constraint the server has not seen before. Verdicts are cached by content, so a
schema sent again costs nothing, a rejected one is rejected at once. Until the checker answers
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


class GrammarChecker:
    """`check(specs)` returns when every (kind, text) spec converts, can finish and compiles within
    `budget_s`; raises CheckFailed otherwise, APIError 429/503 when it cannot check now."""

    def __init__(self, budget_s: float, max_parallel: int) -> None:
        self.budget_s = budget_s
        self.max_parallel = max_parallel
        self._info_path: Path | None = None
        self._configured = False
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._cache: OrderedDict[str, tuple[int | None, str | None] | None] = OrderedDict()
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
                  "max_parallel": self.max_parallel}
        self._proc.stdin.write((json.dumps(config) + "\n").encode())

    async def configure(self, info_json: str | None, timeout_s: float = 300.0) -> None:
        """Hand the checker the model's vocabulary (through a temp file of its own, removed by
        close) and wait until it answers checks."""
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
        future = asyncio.get_running_loop().create_future()
        self._pending[check_id] = future
        self._proc.stdin.write((json.dumps({"id": check_id, "specs": specs, "budget_s": self.budget_s})
                                + "\n").encode())
        try:
            answer = await future
        except asyncio.CancelledError:  # the client went away: stop its compile
            self._pending.pop(check_id, None)
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._proc.stdin.write((json.dumps({"cancel": check_id}) + "\n").encode())
            raise
        verdict = None if answer["ok"] else (answer.get("index"), answer.get("error"))
        self._cache[key] = verdict
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        if verdict is not None:
            raise CheckFailed(*verdict)

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
