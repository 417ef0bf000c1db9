"""Run `python -m moe_serve.service` (or another server module) as a subprocess: start, wait for /health, stop.

Used by the tests (real vLLM CPU engine) and by the benchmarks in bench/ (CPU and H200). The
server runs in its own session, so stop() can reap its engine and worker processes as a group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from moe_serve.kernels.plugin.plugin_metrics import RUNTIME_DIR_ENV

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "moe-serve-tiny-mixtral"
PROGRESS_EVERY_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_core_isolation(env: Mapping[str, str]) -> tuple[dict[str, str], Callable[[], None] | None]:
    """Engine env and a `preexec_fn` that give a CPU-engine server the last core, clients the rest.

    While vLLM's CPU engine generates, its engine-core and worker processes spin (shared-memory
    queue polling with sched_yield) and starve every other process on a 2-vCPU machine; pinned,
    a client's CPU time is its own again.
    Off when the caller binds vLLM's threads itself, with MOE_SERVE_PIN_SERVER=0, on a machine
    with an NVIDIA GPU (/dev/nvidia0..) or on < 2 cores.
    """
    cores = sorted(os.sched_getaffinity(0))
    off = ("VLLM_CPU_OMP_THREADS_BIND" in env or env.get("MOE_SERVE_PIN_SERVER") == "0"
           or any(Path("/dev").glob("nvidia[0-9]*")) or len(cores) < 2)
    if off:
        return {}, None
    core = cores[-1]
    return ({"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            lambda: os.sched_setaffinity(0, {core}))


class ServerProcess:
    """One server subprocess (in its own session) on a free port, logging to log_dir/log_name
    (default server-PORT.log). It gets its own runtime dir (worker metrics files) unless `env`
    names one: a MOE_SERVE_RUNTIME_DIR inherited from this process (set by an app created
    in-process) would make two servers share, and clear, each other's files."""

    def __init__(self, log_dir: Path, *args: str, api_key: str | None = None, env: Mapping[str, str] | None = None,
                 module: str = "moe_serve.service", log_name: str | None = None, cwd: Path = REPO) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / (log_name or f"server-{self.port}.log")
        self.api_key = api_key
        # -P: the cwd (the checkout) stays off sys.path: its kernels/ folder would shadow PyPI's kernels
        cmd = [sys.executable, "-P", "-m", module, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        inherited = {k: v for k, v in os.environ.items() if k != RUNTIME_DIR_ENV}
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        pin_env, pin = server_core_isolation(full_env)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env={**full_env, **pin_env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float, progress: Callable[[str], None] | None = None) -> float:
        """Poll /health until 200; seconds it took. Raises (with the log tail) if the server exits or times out."""
        began = time.monotonic()
        next_note = began + PROGRESS_EVERY_S
        while time.monotonic() - began < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail(60)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            if progress is not None and time.monotonic() > next_note:
                progress(f"  waiting for /health ({time.monotonic() - began:.0f} s): {self.tail(1)[:160]}")
                next_note += PROGRESS_EVERY_S
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout:.0f} s:\n{self.tail(60)}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`), then kill whatever of its group is left. Exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray engine/worker processes of this server only
        except ProcessLookupError:
            pass
        return self.proc.returncode


def start_server(log_dir: Path, *args: str, api_key: str | None = None, env: Mapping[str, str] | None = None,
                 ready_timeout: float = 240.0, module: str = "moe_serve.service", log_name: str | None = None,
                 progress: Callable[[str], None] | None = None, cwd: Path = REPO) -> ServerProcess:
    """Start a server on a free port (log in log_dir/log_name, default server-PORT.log) and wait
    until /health is 200."""
    server = ServerProcess(log_dir, *args, api_key=api_key, env=env, module=module, log_name=log_name,
                           cwd=cwd)
    try:
        server.wait_ready(ready_timeout, progress)
    except BaseException:
        server.stop()
        raise
    return server
