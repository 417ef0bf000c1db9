"""Does a busy vLLM CPU engine starve the other processes on this machine?

Starts the server (embedded model) pinned to its own core or not, opens one long stream that
keeps the engine generating, and meanwhile measures in this (client) process, --trials times:
the wall time of 0.1 s of CPU work, and a /health round trip on a raw socket. Usage (CPU, ~1 min
per mode):

    .venv/bin/python bench/investigations/cpu_starvation_probe.py --out /tmp/starve --modes unpinned,pinned
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from loadtest.server_proc import MODEL_NAME, start_server  # noqa: E402

CPU_WORK_S = 0.1


def open_long_stream(port: int) -> socket.socket:
    """A streamed 4000-token completion whose response this process never reads."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 4000,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.recv(200)  # headers are out: the request is running
    return s


def cpu_work_wall_s() -> float:
    """Wall seconds this process needs to get CPU_WORK_S of CPU time."""
    t, c = time.perf_counter(), time.process_time()
    while time.process_time() - c < CPU_WORK_S:
        pass
    return time.perf_counter() - t


def health_rtt_s(port: int) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as h:
        h.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        h.recv(500)
    return time.perf_counter() - t


def probe(mode: str, out: Path, trials: int) -> dict:
    env = {"MOE_SERVE_PIN_SERVER": "0"} if mode == "unpinned" else {}
    server = start_server(out, "--max-model-len", "4096", env=env)
    try:
        rows = []
        for _ in range(trials):
            stream = open_long_stream(server.port)
            time.sleep(0.3)  # let this process go idle, as a client between chunks does
            rows.append({"cpu_0.1s_wall_s": cpu_work_wall_s(), "health_rtt_s": health_rtt_s(server.port)})
            stream.close()
            time.sleep(1.0)
    finally:
        server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    worst = {k: max(r[k] for r in rows) for k in rows[0]}
    return {"mode": mode, "trials": rows, "median": med, "max": worst}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--modes", default="unpinned,pinned")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [probe(m, args.out, args.trials) for m in args.modes.split(",")]
    (args.out / "starvation.json").write_text(json.dumps(results, indent=2))
    for r in results:
        print(f"{r['mode']:9s} 0.1 s of client CPU took median {r['median']['cpu_0.1s_wall_s']:.3f} s "
              f"(max {r['max']['cpu_0.1s_wall_s']:.3f}); /health round trip median "
              f"{r['median']['health_rtt_s'] * 1000:.1f} ms (max {r['max']['health_rtt_s'] * 1000:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
