"""Worker -> API process through prometheus-client multiprocess files: workers (subprocesses)
write moe_serve.kernels.plugin.plugin_metrics.PluginMetrics, the API side (service/worker_metrics.py) reads them
for /metrics and /version."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.service.worker_metrics import WorkerMetricsCollector, prepare_runtime_dir, workers_summary

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import json, os, sys
from prometheus_client import Counter
from moe_serve.kernels.plugin.plugin_metrics import PluginMetrics, enable_multiprocess
rank, events = sys.argv[1], json.loads(sys.argv[2])
enable_multiprocess(sys.argv[3])
m = PluginMetrics(rank, "optimized")
m.worker_state("warmup", True, True)
m.kernel_info("triton", "n/a", "bf16", 2)
for kernel, phase, kind, n in events:
    m.jit(kernel, phase, kind, n)
m.launch("optimized"); m.launch("optimized"); m.fallback("device")
m.routing("E=8,N=1792,K=4096,dtype=bf16", "1-16:ours,17+:vllm")
m.plan("E=8,N=1792,K=4096,dtype=bf16", "experts 1-16:ours,17+:vllm; router ours M<=16")
m.kernel_info("triton", "true", "bf16", 2)   # after warm-up: swap_ab known
m.worker_state("serving", True, True)
m.warmup_done(1.5, 1)
Counter("vllm:worker_side_total", "what vLLM itself might record in a worker").inc()
print(os.getpid())
"""


def _worker(d: Path, rank: int, events: list) -> int:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(WORKER), str(rank), json.dumps(events), str(d)],
                         cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return int(res.stdout.strip().splitlines()[-1])


def _scrape(d: Path) -> dict[str, list]:
    reg = CollectorRegistry()
    reg.register(WorkerMetricsCollector(d))
    return {f.name: f.samples for f in text_string_to_metric_families(generate_latest(reg).decode())}


def _value(fams: dict, name: str, **labels: str) -> float:
    return sum(s.value for s in fams.get(name, []) if s.name.endswith("_total")
               and all(s.labels.get(k) == v for k, v in labels.items()))


K = "fused_moe_kernel"


def test_counters_sum_per_rank_and_restarted_workers_add(tmp_path: Path) -> None:
    _worker(tmp_path, 0, [[K, "warmup", "compile", 3], [K, "serving", "compile", 1],
                          [K, "serving", "cache_load", 2]])
    _worker(tmp_path, 1, [[K, "warmup", "compile", 3]])
    _worker(tmp_path, 1, [[K, "warmup", "compile", 4], [K, "serving", "compile", 2]])  # rank 1 restarted
    fams = _scrape(tmp_path)
    jit = "moe_serve_triton_jit_compiles"
    assert _value(fams, jit, kernel=K, phase="warmup") == 10
    assert _value(fams, jit, kernel=K, phase="warmup", rank="0") == 3
    assert _value(fams, jit, kernel=K, phase="warmup", rank="1") == 7
    assert _value(fams, jit, kernel=K, phase="serving", rank="1") == 2
    assert _value(fams, "moe_serve_triton_jit_cache_loads", kernel=K, phase="serving") == 2
    launches = {s.labels["path"]: s.value for s in fams["moe_serve_moe_kernel_launches"]
                if s.name.endswith("_total")}
    assert launches == {"optimized": 6, "fallback": 3, "routed_to_vllm": 0}
    assert _value(fams, "moe_serve_moe_kernel_fallbacks", reason="device") == 3
    assert _value(fams, "moe_serve_plugin_warmup_failures") == 0  # exported from start, 0


def test_info_gauges_keep_only_what_holds_now(tmp_path: Path) -> None:
    pids = {_worker(tmp_path, r, []) for r in (0, 1)}
    fams = _scrape(tmp_path)
    workers = [s.labels for s in fams["moe_serve_vllm_worker_info"]]
    assert {w["pid"] for w in workers} == {str(p) for p in pids}
    assert all(w["phase"] == "serving" for w in workers), workers  # the warmup series was set to 0
    assert [s.labels for s in fams["moe_serve_moe_kernel_info"]] == [
        {"backend": "triton", "swap_ab": "true", "dtype": "bf16", "tp_size": "2", "mode": "optimized"}]
    reporting = {s.labels["phase"]: s.value for s in fams["moe_serve_vllm_workers_reporting"]}
    assert reporting == {"warmup": 0, "serving": 2}
    assert [s.labels["routing"] for s in fams["moe_serve_moe_routing_info"]] == ["1-16:ours,17+:vllm"]


def test_only_our_families_are_exported(tmp_path: Path) -> None:
    """A metric vLLM itself records inside a worker lands in the same files; it must not be
    exported twice (vLLM's own series come from the API process)."""
    _worker(tmp_path, 0, [])
    fams = _scrape(tmp_path)
    assert fams and all(name.startswith("moe_serve_") for name in fams), sorted(fams)


def test_version_summary_is_per_worker(tmp_path: Path) -> None:
    p0 = _worker(tmp_path, 0, [[K, "warmup", "compile", 2], [K, "serving", "cache_load", 5]])
    p1 = _worker(tmp_path, 1, [[K, "warmup", "compile", 3], [K, "serving", "compile", 1]])
    s = workers_summary(tmp_path)
    assert [(w["rank"], w["pid"], w["jit_compiles"]) for w in s["workers"]] == [
        (0, p0, {f"{K}|warmup": 2}), (1, p1, {f"{K}|serving": 1, f"{K}|warmup": 3})]
    assert s["jit_compiles"] == {f"{K}|serving": 1, f"{K}|warmup": 5}
    w = s["workers"][0]
    assert (w["mode"], w["phase"], w["moe_hook"]) == ("optimized", "serving", "installed")
    assert w["moe_calls"] == {"optimized": 2, "fallback": 1, "routed_to_vllm": 0}
    assert w["fallback_reasons"] == {"device": 1}
    assert w["kernel_info"] == {"backend": "triton", "swap_ab": "true", "dtype": "bf16", "tp_size": "2",
                                "routing": {"E=8,N=1792,K=4096,dtype=bf16": "1-16:ours,17+:vllm"},
                                "plans": {"E=8,N=1792,K=4096,dtype=bf16": "experts 1-16:ours,17+:vllm; router ours M<=16"}}
    assert w["warmup"] == {"seconds": 1.5, "shapes": 1, "failures": 0}


def test_prepare_runtime_dir_clears_an_earlier_servers_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOE_SERVE_RUNTIME_DIR", str(tmp_path / "rt"))
    d, created = prepare_runtime_dir()
    _worker(d, 0, [])
    assert list(d.glob("*.db")) and not created
    assert prepare_runtime_dir() == (d, False) and not list(d.glob("*.db"))
    monkeypatch.delenv("MOE_SERVE_RUNTIME_DIR")
    fresh, created = prepare_runtime_dir()
    assert fresh.is_dir() and created and os.environ["MOE_SERVE_RUNTIME_DIR"] == str(fresh)
    shutil.rmtree(fresh)


API = """
import sys
from prometheus_client import Counter, CollectorRegistry, generate_latest
from moe_serve.service.metrics import ServiceMetrics
from moe_serve.service.worker_metrics import WorkerMetricsCollector
Counter("vllm:request_success", "what AsyncLLM registers in the API process").inc()
reg = CollectorRegistry()
ServiceMetrics(reg, "m")
reg.register(WorkerMetricsCollector(sys.argv[1]))
print(generate_latest(reg).decode())
"""


def test_api_process_in_multiprocess_mode_exports_each_series_once(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR set for the API process (the user's, or vLLM's own
    multi-API-server set-up), vLLM's series come through DefaultRegistryBridge from that dir
    and the workers' from the runtime dir: each once."""
    from tests.monitoring_helpers import parse_metrics

    runtime, user = tmp_path / "runtime", tmp_path / "user"
    runtime.mkdir()
    user.mkdir()
    _worker(runtime, 0, [[K, "warmup", "compile", 2]])
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(API), str(runtime)], cwd=REPO,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(user)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    samples = parse_metrics(res.stdout)  # raises on a duplicate sample
    names = {name for name, _ in samples}
    assert {"vllm:request_success_total", "moe_serve_requests_total", "moe_serve_triton_jit_compiles_total"} <= names
    assert "vllm:worker_side_total" not in names
    assert samples[("moe_serve_triton_jit_compiles_total",
                    frozenset({"kernel": K, "phase": "warmup", "rank": "0"}.items()))] == 2
