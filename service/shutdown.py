"""Graceful shutdown: on SIGTERM/SIGINT stop admitting, drain, abort stragglers, then exit.

uvicorn would close connections as soon as its own graceful timeout ends; we drain first,
so in-flight streams finish (or end with a final error event) before uvicorn stops. A second
signal cuts the drain short (in-flight requests are aborted at once) but never skips the
app's lifespan shutdown: uvicorn's own second-signal force-exit would leave the engine core
and its workers running and end the process with the signal's code (143) instead of ours.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from moe_serve.service.state import ServerState

logger = logging.getLogger(__name__)
ABORT_FLUSH_S = 5.0  # after aborting, how long streams get to send their final error event
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains in-flight requests and whose later ones
    abort them; either way the lifespan shutdown (engine stop) runs and the exit code is
    `state.exit_code` (uvicorn neither force-exits nor re-raises the signal)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.signals = 0  # exit signals received
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("%s again: aborting in-flight requests, then stopping the engine",
                           signal.Signals(sig).name)
        self.state.shutting_down = True  # /health says so at once; the drain task starts on the next tick

    @property
    def hurry(self) -> bool:
        """A second signal came: stop waiting for in-flight requests."""
        return self.signals > 1

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _wait_in_flight(self, until: float) -> None:
        while self.state.in_flight() and time.monotonic() < until and not self.hurry:
            await asyncio.sleep(POLL_S)

    async def _drain(self) -> None:
        state = self.state
        timeout = 0.0 if state.engine.dead else state.settings.drain_timeout_s
        state.begin_shutdown()
        started = time.monotonic()
        logger.info("draining: %d request(s) in flight, up to %.0f s", state.in_flight(), timeout)
        await self._wait_in_flight(started + timeout)
        if state.in_flight():
            logger.warning("%s: aborting %d request(s)", "second signal" if self.hurry else "drain timeout",
                           state.in_flight())
            await state.engine.abort_all()
            flush_deadline = time.monotonic() + ABORT_FLUSH_S
            while state.in_flight() and time.monotonic() < flush_deadline:  # final error events go out
                await asyncio.sleep(POLL_S)
        logger.info("drained in %.1f s", time.monotonic() - started)
        self.should_exit = True
