"""A small asyncio + httpx closed-loop client that runs the same scenarios as the Locust user.

For hosts without Locust (the H200 host). Writes the same per-request records; the report
code is shared. Every wait is bounded: the run ends at the scenario's end plus `grace_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import httpx

from moe_serve.loadtest.records import RecordWriter, make_record
from moe_serve.loadtest.scenarios import Scenario
from moe_serve.loadtest.stream import StreamTimer, request_body, stream_into


class AsyncRunner:
    """Keeps `stage.users` worker tasks alive per stage; workers loop over requests."""

    def __init__(self, scenario: Scenario, host: str, model: str, api_key: str, records: Path,
                 request_timeout_s: float = 600.0, progress: bool = True) -> None:
        self.sc, self.host, self.model = scenario, host.rstrip("/"), model
        self.headers = {"Accept": "text/event-stream"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.writer = RecordWriter(records)
        self.timeout = request_timeout_s
        self.progress = progress
        self.t0 = 0.0
        self.done = 0
        self.errors = 0
        self._ids = itertools.count()

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def _one(self, client: httpx.AsyncClient, uid: int, rng) -> None:
        spec = self.sc.picker(rng)
        path, body = request_body(spec.endpoint, self.model, spec.prompt, spec.max_tokens)
        timer = StreamTimer(self.clock())
        stage = self.sc.stage_index(timer.t_send)
        status = "cancelled"
        try:
            await stream_into(timer, client, self.host + path, body, self.headers, self.clock)
            timer.finish(self.clock())
            status = "error" if timer.error else "ok"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken connection is a failed request
            timer.error = timer.error or f"{type(exc).__name__}: {exc}"
            timer.finish(self.clock())
            status = "error"
        finally:
            self.writer.write(make_record(stage, uid, spec, timer, status))
        self.done += status == "ok"
        self.errors += status == "error"

    async def _worker(self, client: httpx.AsyncClient, uid: int) -> None:
        rng = self.sc.user_rng(uid)
        while True:
            await self._one(client, uid, rng)

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.timeout, connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            workers: list[asyncio.Task] = []
            self.t0 = time.perf_counter()
            try:
                for i, st in enumerate(self.sc.stages):
                    while len(workers) < st.users:
                        workers.append(asyncio.create_task(self._worker(client, next(self._ids))))
                    while len(workers) > st.users:
                        workers.pop().cancel()
                    if self.progress:
                        print(f"[loadtest] t={self.clock():6.1f}s stage {i} {st.label}: {st.users} users; "
                              f"so far {self.done} ok, {self.errors} errors", flush=True)
                    await asyncio.sleep(max(0.0, st.end - self.clock()))
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 30.0)
                self.writer.close()
        if self.progress:
            print(f"[loadtest] done at t={self.clock():.1f}s: {self.done} ok, {self.errors} errors", flush=True)


def run_async(scenario: Scenario, host: str, model: str, api_key: str, records: Path) -> None:
    """Run `scenario` against `host` with the asyncio engine (blocks until it ends)."""
    asyncio.run(AsyncRunner(scenario, host, model, api_key, records).run())
