import asyncio, httpx, time, sys, random
URL = sys.argv[1]; DUR = float(sys.argv[2]); RANDOM = len(sys.argv) > 3
async def main():
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=60) as c:
        model = (await c.get(URL + "/v1/models")).json()["data"][0]["id"]
        t_end = time.time() + DUR; ttfts = []; itls = []
        while time.time() < t_end:
            prompt = [rng.randrange(1000, 30000) for _ in range(128)] if RANDOM else list(range(1000, 1128))
            body = {"model": model, "prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0, "stream": True}
            t0 = time.perf_counter(); times = []
            async with c.stream("POST", URL + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter() - t0)
            ttfts.append(times[0]); itls += [b - a for a, b in zip(times, times[1:])]
        ttfts.sort(); itls.sort()
        print(len(ttfts), "ttft p50 ms", round(ttfts[len(ttfts)//2]*1e3, 2), "itl p50 ms", round(itls[len(itls)//2]*1e3, 3))
asyncio.run(main())
