"""Start the real `moe-serve` server (real vLLM CPU engine) as a subprocess for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "moe-serve-tiny-mixtral"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_core_isolation(env: Mapping[str, str]) -> tuple[dict[str, str], Callable[[], None] | None]:
    """Engine env and a `preexec_fn` that give a CPU-engine server the last core, clients the rest.

    On the 2-vCPU dev/CI VMs, while vLLM's CPU engine generates, its engine-core and worker
    processes spin (shared-memory queue polling with sched_yield) and starve every other process:
    a client that needed 0.1 s of CPU got it in 7.5 s of wall time, which made streams look
    bursty and disconnects look late (bench/RESULTS.md, 2026-11-29). Pinned, 0.1 s took 0.1 s.
    Off when the caller binds vLLM's threads itself, with MOE_SERVE_PIN_SERVER=0, or on < 2 cores.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or "VLLM_CPU_OMP_THREADS_BIND" in env or env.get("MOE_SERVE_PIN_SERVER") == "0":
        return {}, None
    core = cores[-1]
    return ({"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            lambda: os.sched_setaffinity(0, {core}))


@dataclass
class RunningServer:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; SIGKILL the whole group if it does not exit in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def start_server(log_dir: Path, *args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 ready_timeout: float = 240.0, module: str = "service") -> RunningServer:
    """Start `python -m service` on a free port and wait until /health is 200."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    pin_env, pin = server_core_isolation(full_env)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**full_env, **pin_env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pin)
    server = RunningServer(proc, f"http://127.0.0.1:{port}", log_path, api_key)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"server not ready in {ready_timeout} s:\n{server.log()[-4000:]}")
