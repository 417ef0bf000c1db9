"""Latency of one request after the server sat idle for a given gap: ours vs vLLM's api_server.

    .venv/bin/python bench/investigations/idle_probe.py --out /tmp/idle          # both servers, ~3 min on the CPU engine

Each server starts on the embedded model (its own core, loadtest/server_proc), then gets one
non-streamed 4-token completion after each idle gap in --gaps (seconds), from one kept-alive
client. Prints and writes idle.json: {server: [[gap_s, latency_ms], ...]}. This is what the
first request of a load stage measures (issue 2: the c=1 TTFT p99 cell).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import serve_servers as ss  # noqa: E402
from service.embedded_model import ensure_embedded_model  # noqa: E402

GAPS = (0, 0, 0, 0.1, 0.3, 1, 2, 3, 5, 0, 0, 10, 0)
OURS, VLLM = "moe-serve", "vllm-api-server"          # the servers' names in idle.json
FLAGS = ss.EngineFlags(None, 4096, 256, 1, None, ss.CPU_KV_CACHE_BYTES)


def start(name: str, out: Path) -> ss.Server:
    """moe-serve or vLLM's OpenAI server on the embedded model, the yardstick's way (bench/serve_servers.py)."""
    server = ss.Server(ss.OURS if name == OURS else ss.BASELINE, out / f"{name}.log", ensure_embedded_model(), FLAGS)
    try:
        server.wait_ready(400, print)
    except BaseException:
        server.stop()
        raise
    return server


def probe(base_url: str, gaps: list[float]) -> list[list[float]]:
    """[[gap s, request latency ms], ...] in the order of `gaps`."""
    body = {"model": ss.SERVED_NAME, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    rows = []
    with httpx.Client(timeout=60) as client:
        client.get(base_url + "/health")
        for gap in gaps:
            time.sleep(gap)
            began = time.perf_counter()
            client.post(base_url + "/v1/completions", json=body).raise_for_status()
            rows.append([gap, round(1000 * (time.perf_counter() - began), 1)])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gaps", default=",".join(map(str, GAPS)), help="idle seconds before each request")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    gaps = [float(g) for g in a.gaps.split(",")]
    results = {}
    for name in (OURS, VLLM):
        server = start(name, a.out)
        try:
            results[name] = probe(server.base_url, gaps)
        finally:
            server.stop()
    (a.out / "idle.json").write_text(json.dumps(results, indent=1))
    print("| idle gap s | " + " | ".join(f"{n} ms" for n in results) + " |\n|---:|" + "---:|" * len(results))
    for i, gap in enumerate(gaps):
        print(f"| {gap:g} | " + " | ".join(f"{results[n][i][1]:.1f}" for n in results) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
