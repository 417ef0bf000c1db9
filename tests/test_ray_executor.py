"""moe-serve over vLLM's Ray executor, on the CPU engine: a Ray head started here, the real server
with --distributed-executor-backend ray at TP=2, one Ray worker actor per rank.

vLLM's CPU platform refuses Ray ("current platform cpu does not support ray."): the test-only
platform plugin tests/vllm_ray_cpu_platform gives it Ray's "GPU" resource key, which the head
declares twice; the rest is vLLM's and Ray's own code. The Ray head stands for another node: it
hands its workers a runtime dir of its own (MOE_SERVE_RUNTIME_DIR, which vLLM's Ray executor does
not overwrite), which the API process never reads, so every rank's plugin series reach /metrics
and /version only over collective_rpc (moe_serve.kernels.plugin.plugin_metrics.worker_report), as they do
from another machine. The test plugin (tests/vllm_test_plugin) makes the series non-trivial:
real MoE calls through the plugin's hook (launches) and Triton compiles in both phases per rank.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.loadtest.server_proc import MODEL_NAME, REPO, ServerProcess, free_port, start_server
from tests.plugin_env import plugin_server_env

pytest.importorskip("ray")

TP = 2
RAY_CPU_PLATFORM = Path(__file__).resolve().with_name("vllm_ray_cpu_platform")
HEAD_READY = "Ray runtime started"


def _pythonpath(env: dict[str, str]) -> str:
    """The test plugins, then whatever was there (moe_serve as installed)."""
    return os.pathsep.join(p for p in (env["PYTHONPATH"], str(RAY_CPU_PLATFORM),
                                       os.environ.get("PYTHONPATH")) if p)


class RayHead:
    """`ray start --head --block` in its own session (a temp dir of its own, local ports): the
    process group holds GCS, raylet and the worker actors, and stop() ends exactly that group."""

    def __init__(self, log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
        self.log = log
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--node-ip-address", "127.0.0.1", "--port", str(self.port), "--num-cpus", "2",
               "--num-gpus", str(TP), "--include-dashboard=false", "--disable-usage-stats",
               "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
               "--object-store-memory", str(100 * 1024 * 1024), "--temp-dir", self.temp_dir]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if HEAD_READY in self.log.read_text(errors="replace"):
                with socket.create_connection(("127.0.0.1", self.port), timeout=5):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"ray head not ready in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # GCS, raylet and workers left in the group
        except ProcessLookupError:
            pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class RayCluster:
    def __init__(self, server: ServerProcess, head: RayHead, api_dir: Path, node_dir: Path, start_s: float):
        self.server, self.head, self.api_dir, self.node_dir, self.start_s = server, head, api_dir, node_dir, start_s


def _complete(srv: ServerProcess, max_tokens: int = 4) -> dict:
    r = httpx.post(srv.base_url + "/v1/completions", timeout=180,
                   json={"model": MODEL_NAME, "prompt": "Hello there, how are", "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    tmp = tmp_path_factory.mktemp("ray")
    plugins = plugin_server_env(probe_kernel="1", cpu_moe="1")
    path = _pythonpath(plugins)
    node_dir, api_dir = tmp / "other-node-runtime", tmp / "api-runtime"
    began = time.monotonic()
    # The head spawns the worker actors: its env is theirs (tests/kernels/conftest.py leaves
    # TRITON_INTERPRET=1 in this process, under which the workers' sm_90 compiles fail).
    head = RayHead(tmp / "ray-head.log", {"PYTHONPATH": path, "MOE_SERVE_RUNTIME_DIR": str(node_dir),
                                          "RAY_USAGE_STATS_ENABLED": "0", "TRITON_INTERPRET": "0"})
    try:
        head.wait_ready()
        env = {**plugins, "PYTHONPATH": path, "RAY_ADDRESS": head.address, "VLLM_CPU_OMP_THREADS_BIND": "0|1",
               "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / "triton-cache"),
               "MOE_SERVE_RUNTIME_DIR": str(api_dir), "MOE_SERVE_MOE_ROUTING": "ours"}
        # cwd outside the checkout: Ray puts the driver's cwd on its workers' sys.path, where
        # the checkout's kernels/ folder would shadow PyPI's kernels (transformers imports it)
        srv = start_server(tmp, "--distributed-executor-backend", "ray", "--tensor-parallel-size", str(TP),
                           "--engine-arg", "enforce_eager=true", env=env, ready_timeout=600, cwd=tmp)
        try:
            _complete(srv)
            yield RayCluster(srv, head, api_dir, node_dir, time.monotonic() - began)
        finally:
            srv.stop()
    finally:
        head.stop()


def _families(srv: ServerProcess) -> dict[str, list]:
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _total(fams: dict[str, list], family: str, **labels: str) -> float:
    return sum(s.value for s in fams.get(family, [])
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def _ray_worker_pids(log: str) -> set[str]:
    """Pids of Ray worker actors in which vLLM loaded the moe-serve plugin (their lines, relayed by Ray)."""
    return {m.group(1) for m in re.finditer(r"\(RayWorkerProc pid=(\d+)\).*moe-serve plugin loaded \(pid \1,", log)}


def test_plugin_registers_in_every_ray_worker(cluster: RayCluster) -> None:
    print(f"Ray head + server ready and one request served in {cluster.start_s:.0f} s")
    pids = _ray_worker_pids(cluster.server.log())
    assert len(pids) == TP, cluster.server.tail(80)
    workers = [s.labels for s in _families(cluster.server)["moe_serve_vllm_worker_info"]]
    assert sorted(w["rank"] for w in workers) == [str(r) for r in range(TP)], workers
    assert {w["pid"] for w in workers} == pids
    for w in workers:
        assert (w["mode"], w["moe_hook"], w["jit_monitor"], w["phase"]) == ("optimized", "installed", "true",
                                                                            "serving"), w


def test_every_rank_reports_over_collective_rpc(cluster: RayCluster) -> None:
    """The API process's runtime dir holds no worker file: all of it came over collective_rpc."""
    assert [p.name for p in cluster.api_dir.iterdir()] == ["server-id"]
    pids = _ray_worker_pids(cluster.server.log())
    assert {p.stem.rsplit("_", 1)[1] for p in cluster.node_dir.glob("*.db")} == pids
    fams = _families(cluster.server)
    assert {s.labels["phase"]: s.value for s in fams["moe_serve_vllm_workers_reporting"]} == \
        {"warmup": 0, "serving": TP}
    for rank in map(str, range(TP)):  # the probe kernel compiles once in each phase, in each worker
        for phase in ("warmup", "serving"):
            assert _total(fams, "moe_serve_triton_jit_compiles", rank=rank, phase=phase) >= 1, (rank, phase)
    before = _total(fams, "moe_serve_moe_kernel_launches", path="optimized")
    paths = {p: _total(fams, "moe_serve_moe_kernel_launches", path=p) for p in ("optimized", "fallback")}
    reasons = {s.labels["reason"]: s.value for s in fams.get("moe_serve_moe_kernel_fallbacks", [])
               if s.name.endswith("_total")}
    assert before > 0 and paths["fallback"] == 0, (paths, reasons)
    _complete(cluster.server, max_tokens=6)
    assert _total(_families(cluster.server), "moe_serve_moe_kernel_launches", path="optimized") > before  # fresh


def test_version_lists_every_rank(cluster: RayCluster) -> None:
    version = httpx.get(cluster.server.base_url + "/version", timeout=30).json()
    workers = version["workers"]
    assert [w["rank"] for w in workers] == list(range(TP))
    assert {str(w["pid"]) for w in workers} == _ray_worker_pids(cluster.server.log())
    fams = _families(cluster.server)
    for w in workers:
        assert w["node"] == socket.gethostname() and w["phase"] == "serving" and w["moe_calls"]["optimized"] > 0
        serving = sum(v for k, v in w["jit_compiles"].items() if k.endswith("|serving"))
        assert serving == _total(fams, "moe_serve_triton_jit_compiles", rank=str(w["rank"]), phase="serving") >= 1
