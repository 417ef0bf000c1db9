"""The vLLM plugin in real engine workers (vLLM CPU): reports per worker, JIT counts in /metrics.

Two server starts: TP=2 with --moe-kernels optimized (and the test probe kernel compiled in
each worker: once in warm-up, once right after the flip to serving), and TP=1 with
--moe-kernels vllm.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.server_proc import MODEL_NAME, ServerProcess, start_server

TP = 2


def _env(tmp) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "TRITON_INTERPRET": "0",  # real compiles, not the interpreter
            "TRITON_CACHE_DIR": str(tmp / "triton-cache"), "MOE_SERVE_TEST_JIT_KERNEL": "1"}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("plugin-tp2")
    env = {**_env(tmp), "MOE_SERVE_RUNTIME_DIR": str(tmp / "runtime")}
    srv = start_server(tmp, "--tensor-parallel-size", str(TP), "--moe-kernels", "optimized", env=env,
                       ready_timeout=400)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("plugin-stock")
    env = {k: v for k, v in _env(tmp).items() if k != "MOE_SERVE_TEST_JIT_KERNEL"}
    srv = start_server(tmp, "--tensor-parallel-size", "1", "--moe-kernels", "vllm", env=env, ready_timeout=400)
    yield srv
    srv.stop()


def _metrics(srv: ServerProcess) -> dict[str, list]:
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _workers(srv: ServerProcess) -> list[dict[str, str]]:
    return [s.labels for s in _metrics(srv).get("moe_serve_vllm_worker_info", [])]


def _compiles(srv: ServerProcess, kernel: str, by: str = "phase") -> dict[str, float]:
    """One kernel's compile counter summed over the other labels, keyed by label `by`."""
    out: dict[str, float] = {}
    for s in _metrics(srv).get("moe_serve_triton_jit_compiles", []):
        if s.labels["kernel"] == kernel and s.name.endswith("_total"):
            out[s.labels[by]] = out.get(s.labels[by], 0.0) + s.value
    return out


def _complete(srv: ServerProcess) -> None:
    r = httpx.post(srv.base_url + "/v1/completions", timeout=120,
                   json={"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_plugin_loads_in_every_worker(tp2: ServerProcess) -> None:
    _complete(tp2)
    workers = _workers(tp2)
    server_pid = str(tp2.proc.pid)
    assert len(workers) == TP, workers
    assert sorted(w["rank"] for w in workers) == [str(r) for r in range(TP)]
    pids = {w["pid"] for w in workers}
    assert len(pids) == TP and server_pid not in pids, (pids, server_pid)  # reported by workers, not the API
    for w in workers:
        assert (w["mode"], w["moe_hook"], w["jit_monitor"], w["phase"]) == ("optimized", "installed", "true",
                                                                            "serving"), w


def test_worker_compiles_reach_metrics_by_phase(tp2: ServerProcess) -> None:
    counts = _compiles(tp2, "_probe_kernel")
    assert counts == {"warmup": TP, "serving": TP}, counts  # one per worker per phase, summed
    per_rank = _compiles(tp2, "_probe_kernel", by="rank")
    assert per_rank == {str(r): 2.0 for r in range(TP)}, per_rank  # each rank's own series
    log = tp2.log()
    assert log.count("Triton JIT compile during serving") >= TP
    assert "kernel=_probe_kernel cause: n:" in log  # names the argument whose specialization changed


def test_kernel_info_from_workers(tp2: ServerProcess) -> None:
    info = [s.labels for s in _metrics(tp2)["moe_serve_moe_kernel_info"]]
    assert info == [{"backend": "auto", "swap_ab": "n/a", "dtype": "bf16", "tp_size": str(TP),
                     "mode": "optimized"}], info


def test_stock_mode_changes_what_workers_report(stock: ServerProcess) -> None:
    _complete(stock)
    workers = _workers(stock)
    assert len(workers) == 1 and workers[0]["pid"] != str(stock.proc.pid), workers
    assert (workers[0]["mode"], workers[0]["moe_hook"], workers[0]["phase"]) == ("vllm", "absent", "serving")
    assert _compiles(stock, "_probe_kernel") == {}
    info = [s.labels for s in _metrics(stock)["moe_serve_moe_kernel_info"]]
    assert [i["mode"] for i in info] == ["vllm"] and info[0]["tp_size"] == "1"


def test_runtime_dir_from_env_is_used(tp2: ServerProcess) -> None:
    runtime = os.path.join(os.path.dirname(tp2.log_path), "runtime")
    files = sorted(f for f in os.listdir(runtime) if f.startswith("worker-"))
    assert len(files) == TP, files
