"""Raw chunk timestamps of concurrent streams: TTFT and the gaps between SSE chunks.

    .venv/bin/python bench/investigations/stream_probe.py http://127.0.0.1:8000 [--chat] [--concurrency 1 4]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx


async def one_stream(client: httpx.AsyncClient, url: str, chat: bool, model: str) -> list[float]:
    """Seconds from send to each content chunk of one streamed request."""
    text = "hello world " * 60
    body = ({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    body |= {"model": model, "max_tokens": 32, "ignore_eos": True, "stream": True}
    began, times = time.perf_counter(), []
    async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - began)
    return times


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--model", default="moe-serve-tiny-mixtral")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = p.parse_args()
    async with httpx.AsyncClient(timeout=60) as client:
        for conc in args.concurrency:
            for times in await asyncio.gather(*[one_stream(client, args.url, args.chat, args.model)
                                                for _ in range(conc)]):
                gaps = [round((b - a) * 1000, 1) for a, b in zip(times, times[1:])]
                print(f"concurrency {conc}: TTFT {times[0] * 1000:.1f} ms, first gaps (ms) {gaps[:12]}")


if __name__ == "__main__":
    asyncio.run(main())
