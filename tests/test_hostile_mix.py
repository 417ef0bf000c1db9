"""A hostile mix, concurrently, against the real server: afterwards nothing is left in the engine and
the API process's memory is back near where it was."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.engine
ROUNDS = 3
RSS_BUDGET_MB = 150
SETTLE_TIMEOUT_S = 60.0
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _schema(schema: dict) -> dict:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _raw(srv: ServerProcess, data: bytes, hold_s: float = 0.0) -> None:
    """Send `data` on a fresh connection, keep it open `hold_s`, read what comes, close."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(data)
        time.sleep(hold_s)
        sock.settimeout(0.5)
        try:
            sock.recv(65536)
        except (TimeoutError, ConnectionError):
            pass


def _disconnecting_stream(srv: ServerProcess) -> int:
    body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.base_url + CMPL, json=body, headers=srv.headers, timeout=60) as resp:
        next(resp.iter_lines())  # the first event, then hang up
        return resp.status_code


def _mix(srv: ServerProcess, round_no: int) -> Counter:
    """One round of hostile (and a few ordinary) requests at once; status code -> count."""
    key = srv.headers["Authorization"].encode()
    surrogate = b'{"model": "%s", "prompt": "x", "max_tokens": 2, "stop": "\\ud800"%s}'
    partial = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + key +
               b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"prompt\": ")
    sends: list[tuple[str, dict | bytes]] = [
        (CMPL, surrogate % (MODEL_NAME.encode(), b"")), (CMPL, surrogate % (MODEL_NAME.encode(), b', "stream": true')),
        (CHAT, _schema({"$ref": "#"})),
        (CHAT, _schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
        (CHAT, _schema({"enum": [f"v{i}-{round_no}" for i in range(100_000)]})),
        (CHAT, _schema({"type": "string", "pattern": f"^[a-z]{{1,{30_000 + round_no}}}$"})),  # over budget, new
        (CMPL, b'{"prompt": "x", "logit_bias": {"1": NaN}}'), (CMPL, b'{"prompt": "x", "stream": "yes"}'),
        (CMPL, {"model": MODEL_NAME, "prompt": "fine", "max_tokens": 4}),
        (CHAT, _schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})),
    ]
    codes: Counter = Counter()
    lock = threading.Lock()

    def run(job: Callable[[], int | None]) -> None:
        status = job()
        with lock:
            codes[status] += 1

    def post(path: str, body: dict | bytes) -> Callable[[], int]:
        if isinstance(body, bytes):
            return lambda: httpx.post(srv.base_url + path, content=body, timeout=120,
                                      headers={**srv.headers, "content-type": "application/json"}).status_code
        return lambda: httpx.post(srv.base_url + path, json=body, headers=srv.headers, timeout=120).status_code

    jobs = [post(path, body) for path, body in sends * 2]
    jobs += [lambda: _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a", hold_s=2.0)] * 10  # slowloris
    jobs += [lambda: _raw(srv, partial, hold_s=0.5)] * 5  # a body shorter than its Content-Length, then gone
    jobs += [lambda: _raw(srv, b"\x16\x03\x01garbage\r\n\r\n")] * 3
    jobs += [lambda: _disconnecting_stream(srv)] * 5
    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return codes


def _settled(srv: ServerProcess, idle_unfinished: int) -> dict:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        health = httpx.get(srv.base_url + "/health", timeout=10).json()
        done = health["unfinished_requests"] == idle_unfinished and health["running"] == 0
        if done or time.monotonic() > deadline:
            return health
        time.sleep(0.25)


def test_hostile_mix_leaves_no_engine_requests_and_no_memory_behind(server: ServerProcess) -> None:
    idle_unfinished = httpx.get(server.base_url + "/health").json()["unfinished_requests"]
    first = _mix(server, 0)  # warms what a first request of each kind loads once
    assert first[500] == 0 and first[200] >= 4, first
    _settled(server, idle_unfinished)
    idle_rss = _rss_mb(server.proc.pid)
    for round_no in range(1, ROUNDS + 1):
        codes = _mix(server, round_no)
        assert codes[500] == 0 and codes[200] >= 4 and codes[400] >= 16, codes
    health = _settled(server, idle_unfinished)
    assert health["unfinished_requests"] == idle_unfinished and health["running"] == 0, health
    time.sleep(2.0)  # the periodic malloc_trim and the lingering connections' close
    grown = _rss_mb(server.proc.pid) - idle_rss
    assert grown < RSS_BUDGET_MB, f"API process RSS grew {grown:.0f} MB over {ROUNDS} hostile rounds"
    assert httpx.post(server.base_url + CMPL, json={"model": MODEL_NAME, "prompt": "after", "max_tokens": 2},
                      headers=server.headers, timeout=60).status_code == 200
