"""A second SIGTERM/SIGINT during the drain: in-flight requests are aborted at once, the engine
and its workers still stop, nothing is left in the server's process group, and the exit code is
the server's own (0 for a requested stop), not the signal's 143."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from moe_serve.loadtest.server_proc import start_server
from moe_serve.service.shutdown import DrainingServer
from moe_serve.service.engine import ENGINE_EXIT_GRACE_S
from moe_serve.service.shutdown import ABORT_FLUSH_S
from tests.test_lifecycle import FORCE_KILL, _group_alive, _stream, drained_seconds


def _group(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip() and " Z" not in line]


@pytest.mark.engine
def test_second_sigterm_during_drain_still_stops_engine_and_keeps_exit_code(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--drain-timeout", "120")
    pgid = server.proc.pid
    try:
        assert len(_group(pgid)) >= 2, f"no engine process in the group: {_group(pgid)}"
        events: list[str] = []
        errors: list[str] = []
        stream = threading.Thread(target=_stream, args=(server, 4000, events, errors))
        stream.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events, "the stream did not start"
        server.proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        while time.monotonic() - sent_at < 10:  # the first signal took effect: the drain runs
            health = httpx.get(server.base_url + "/health", timeout=5)
            if health.status_code == 503:
                break
        assert health.json()["status"] == "shutting_down"
        assert server.proc.poll() is None, "the drain (up to 120 s) must still be waiting for the stream"
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(ABORT_FLUSH_S + ENGINE_EXIT_GRACE_S + 30)
        stream.join(30)
    finally:
        leftovers = _group_alive(pgid)
        server.stop()  # kills whatever is left, so a failure leaves nothing running
    log = server.log()
    assert code == 0, log[-3000:]
    assert drained_seconds(log) < 20, "the second signal did not cut the 120 s drain short"
    assert FORCE_KILL not in log, log[-3000:]
    assert leftovers == [], f"processes left behind: {leftovers}"
    assert "shutting down engine" in log, log[-3000:]
    assert not errors, errors
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]


class _State(SimpleNamespace):
    def in_flight(self) -> int:
        return 0


def test_repeated_sigint_never_turns_into_uvicorns_force_exit() -> None:
    """uvicorn's own handler force-exits on a second SIGINT (lifespan shutdown skipped) and
    re-raises captured signals after serving (exit code 130/143)."""
    state = _State(shutting_down=False)
    server = DrainingServer(uvicorn.Config(app=None), state)  # type: ignore[arg-type]
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        server.handle_exit(sig, None)
    assert state.shutting_down and server.hurry
    assert not server.force_exit and not server._captured_signals
