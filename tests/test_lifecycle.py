"""Shutdown and failure: SIGTERM drains streams, a dead engine worker fails health and the exit code."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server
from moe_serve.service.engine import ENGINE_EXIT_GRACE_S
from moe_serve.service.shutdown import ABORT_FLUSH_S

pytestmark = pytest.mark.engine
DRAIN_S = 3.0
FORCE_KILL = "force killing"  # vLLM's words when the engine core or a worker outlived its grace


def drained_seconds(log: str) -> float:
    """The drain's duration from the server log ("drained in X s")."""
    match = re.search(r"drained in ([0-9.]+) s", log)
    assert match, log[-3000:]
    return float(match.group(1))


def _group_alive(pgid: int, wait_s: float = 15.0) -> list[str]:
    """Processes still in the server's process group after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True,
                             text=True).stdout
        alive = [line.strip() for line in out.splitlines() if line.strip() and " Z" not in line]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _stream(server: ServerProcess, max_tokens: int, events: list, errors: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "Go on:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:  # a cut connection is a failure of the drain
        errors.append(repr(exc))


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_drains_finishable_streams_and_ends_the_rest_with_an_error_event(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--drain-timeout", str(DRAIN_S))
    pgid = server.proc.pid
    short_events: list[str] = []
    long_events: list[list[str]] = [[] for _ in range(3)]
    errors: list[str] = []
    threads = [threading.Thread(target=_stream, args=(server, 4000, ev, errors)) for ev in long_events]
    threads.append(threading.Thread(target=_stream, args=(server, 8, short_events, errors)))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(long_events) and time.monotonic() < deadline:  # every long stream has started
        time.sleep(0.05)
    assert all(long_events), "long streams did not start"
    assert httpx.get(server.base_url + "/health", timeout=5).json()["running"] >= 3
    server.proc.send_signal(signal.SIGTERM)
    sent_at = time.monotonic()
    health = httpx.get(server.base_url + "/health", timeout=5)
    while health.status_code == 200 and time.monotonic() - sent_at < 2:  # the signal may land after this GET
        health = httpx.get(server.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"
    for t in threads:
        t.join(60)
    code = server.proc.wait(DRAIN_S + ABORT_FLUSH_S + ENGINE_EXIT_GRACE_S + 10)
    log = server.log()
    assert code == 0, log[-3000:]
    assert drained_seconds(log) < DRAIN_S + ABORT_FLUSH_S, log[-3000:]  # the 4000-token streams were not awaited
    assert FORCE_KILL not in log, log[-3000:]  # the engine core and its worker exited by themselves
    assert not errors, errors
    assert short_events[-1] == "[DONE]"
    short_chunks = [json.loads(e) for e in short_events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in short_chunks][-1] == "length"
    for events in long_events:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last.get("error", {}).get("code") == "shutting_down" or \
            last["choices"][0]["finish_reason"] == "length", last
    assert any("error" in json.loads(ev[-2]) for ev in long_events)  # 4000 tokens can't finish in 3 s
    assert _group_alive(pgid) == [], "processes left behind"


def test_killing_an_engine_process_fails_health_and_exits_non_zero(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    pgid = server.proc.pid
    engine_procs = [p for p in _children(server.proc.pid)  # not the structured-output checker
                    if b"moe_serve.service.grammar_worker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert engine_procs, "no engine subprocess found"
    victims = [p for core in engine_procs for p in _children(core)] or engine_procs
    os.kill(victims[0], signal.SIGKILL)
    saw_503 = False
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            saw_503 |= httpx.get(server.base_url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    code = server.proc.wait(30)
    assert code != 0, server.log()[-3000:]
    assert saw_503 or "engine core died" in server.log()
    assert _group_alive(pgid) == [], "processes left behind"
