"""The yardstick's load: fixed closed-loop streaming `/v1/completions` at a concurrency c.

Every request has the same shape: a prompt of exactly `prompt_tokens` token ids (sent as ids, so
both servers see identical prompts without a tokenizer round trip; distinct per request, so no
prefix-cache hit turns it into a cache test; the same ids in every process), `max_tokens =
output_tokens` with `ignore_eos`, temperature 0 (loadtest/stream.request_body). A request whose
usage does not report exactly those prompt and completion token counts is an error.

Per level: c workers keep exactly c requests in flight; the first `warmup` requests are warm-up
(recorded with phase "warmup", not measured), then `measured` requests. With equal output lengths
the c streams run in lock step, so `warmup` and `measured` are best multiples of c. Each request
is written (loadtest/records: one JSON line as it finishes) with its chunk gaps in microseconds.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from moe_serve.loadtest.records import Record, RecordWriter, make_record
from moe_serve.loadtest.scenarios import RequestSpec
from moe_serve.loadtest.stream import StreamTimer, request_body, stream_into

FIRST_PROMPT_ID = 1000            # prompt ids are drawn from [FIRST_PROMPT_ID, vocab)


@dataclass
class TokenTimer(StreamTimer):
    """StreamTimer that also keeps the arrival time of every content chunk."""

    chunk_times: list[float] = field(default_factory=list)

    def line(self, raw: bytes | str, now: float) -> bool:
        before = self.chunks
        done = super().line(raw, now)
        if self.chunks != before:
            self.chunk_times.append(now)
        return done


@dataclass
class LoadRecord(Record):
    """loadtest's Record plus the yardstick's fields (times in s from the process's load start)."""

    level: int = 0                  # concurrency c
    phase: str = "measured"         # warmup | measured | profile-short | profile-long
    index: int = 0                  # request number within the level (picks the prompt)
    chunks: int = 0                 # content chunks received (< output_tokens if the server coalesced)
    itl_us: list[int] = field(default_factory=list)     # gaps between consecutive chunks, us


def prompt_ids(level: int, index: int, tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """The prompt of request `index` at concurrency `level`: `tokens` ids below `vocab` (the ids
    the model's tokenizer decodes: moe_serve.bench.model_dirs.decodable_ids), the same in every run."""
    rng = random.Random(f"yardstick-{seed}-{level}-{index}")
    return [rng.randrange(min(FIRST_PROMPT_ID, vocab // 2), vocab) for _ in range(tokens)]


class LoadClient:
    """Streams requests at one server and writes their records."""

    def __init__(self, base_url: str, model: str, prompt_tokens: int, vocab: int, records: Path,
                 request_timeout_s: float = 300.0) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.prompt_tokens, self.vocab = prompt_tokens, vocab
        self.writer = RecordWriter(records)
        self.t0 = time.perf_counter()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout_s, connect=30.0))

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def close(self) -> None:
        await self.http.aclose()
        self.writer.close()

    async def post(self, path: str) -> int:
        """POST with an empty body (the profiler routes); the status code."""
        return (await self.http.post(self.base_url + path)).status_code

    async def one(self, stage: int, level: int, index: int, phase: str, output_tokens: int) -> LoadRecord:
        """One streamed request; its record (written)."""
        ids = prompt_ids(level, index, self.prompt_tokens, self.vocab)
        path, body = request_body("completions", self.model, ids, output_tokens)  # type: ignore[arg-type]
        timer = TokenTimer(self.clock())
        try:
            await stream_into(timer, self.http, self.base_url + path, body,
                              {"Accept": "text/event-stream"}, self.clock)
        except Exception as exc:  # noqa: BLE001 - a broken connection is a failed request
            timer.error = timer.error or f"{type(exc).__name__}: {exc}"
        timer.finish(self.clock())
        if timer.error is None and (timer.prompt_tokens, timer.usage_tokens) != (self.prompt_tokens, output_tokens):
            timer.error = (f"usage says {timer.prompt_tokens} prompt / {timer.usage_tokens} completion tokens, "
                           f"sent {self.prompt_tokens} / asked {output_tokens}")
        spec = RequestSpec(kind=phase, endpoint="completions", prompt="", max_tokens=output_tokens)
        base = make_record(stage, 0, spec, timer, "error" if timer.error else "ok")
        gaps = [round((b - a) * 1e6) for a, b in zip(timer.chunk_times, timer.chunk_times[1:])]
        rec = LoadRecord(**asdict(base), level=level, phase=phase, index=index, chunks=timer.chunks, itl_us=gaps)
        self.writer.write(rec)
        return rec

    async def level(self, stage: int, c: int, warmup: int, measured: int, output_tokens: int) -> list[LoadRecord]:
        """Closed loop: c workers, `warmup` then `measured` requests in all; the records."""
        numbers = itertools.count()
        out: list[LoadRecord] = []

        async def worker() -> None:
            while (i := next(numbers)) < warmup + measured:
                out.append(await self.one(stage, c, i, "warmup" if i < warmup else "measured", output_tokens))

        await asyncio.gather(*(worker() for _ in range(c)))
        return out

    async def burst(self, stage: int, c: int, output_tokens: int, phase: str) -> tuple[float, list[LoadRecord]]:
        """c requests sent at once (prompts numbered after the level's): (wall seconds, records)."""
        first = 10_000 + 1_000 * (phase == "profile-long")
        began = self.clock()
        recs = await asyncio.gather(*(self.one(stage, c, first + i, phase, output_tokens) for i in range(c)))
        return self.clock() - began, list(recs)
