"""Graceful shutdown: on SIGTERM/SIGINT stop admitting, drain, abort stragglers, then exit.

uvicorn would close connections as soon as its own graceful timeout ends; we drain first,
so in-flight streams finish (or end with a final error event) before uvicorn stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from service.state import ServerState

logger = logging.getLogger(__name__)
ABORT_FLUSH_S = 5.0  # after aborting, how long streams get to send their final error event


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains in-flight requests first."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested:  # a second signal: stop now
            logger.warning("second %s: exiting without waiting for in-flight requests", signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self._drain_requested = True
        self.state.shutting_down = True  # /health says so at once; the drain task starts on the next tick

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        state = self.state
        timeout = 0.0 if state.engine.dead else state.settings.drain_timeout_s
        state.begin_shutdown()
        started = time.monotonic()
        logger.info("draining: %d request(s) in flight, up to %.0f s", state.in_flight(), timeout)
        while state.in_flight() and time.monotonic() - started < timeout:
            await asyncio.sleep(0.05)
        if state.in_flight():
            logger.warning("drain timeout: aborting %d request(s)", state.in_flight())
            await state.engine.abort_all()
            flush_deadline = time.monotonic() + ABORT_FLUSH_S
            while state.in_flight() and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
        logger.info("drained in %.1f s", time.monotonic() - started)
        self.should_exit = True
