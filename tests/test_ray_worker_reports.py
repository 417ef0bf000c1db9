"""Workers whose metrics files the API process cannot read (another node under vLLM's Ray executor)
report through collective_rpc (moe_serve.kernels.plugin.plugin_metrics.worker_report); the API side
(moe_serve.service.worker_metrics) combines those reports with this node's files for /metrics and /version.
Real worker processes write real multiprocess files; the engine's collective_rpc is a stand-in
here (tests/test_ray_executor.py runs the real one)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.kernels.plugin import plugin_metrics as pm
from moe_serve.service.worker_metrics import RemoteWorkers, WorkerMetricsCollector, prepare_runtime_dir, workers_summary

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import json, sys
from moe_serve.kernels.plugin.plugin_metrics import PluginMetrics, enable_multiprocess, ensure_runtime_dir, worker_report
rank, runtime_dir, server_id = sys.argv[1:4]
assert ensure_runtime_dir(runtime_dir)
enable_multiprocess(runtime_dir)
m = PluginMetrics(rank, "optimized")
m.worker_state("serving", True, True)
m.kernel_info("triton", "true", "bf16", 2)
m.jit("fused_moe_kernel", "warmup", "compile", 3)
m.jit("fused_moe_kernel", "serving", "compile", int(rank))
m.launch("optimized"); m.launch("optimized"); m.fallback("device")
m.warmup_done(1.5, 1)
print(json.dumps(worker_report(runtime_dir, server_id)))
"""


def _worker(rank: int, runtime_dir: Path, server_id: str) -> dict[str, Any] | None:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(WORKER), str(rank), str(runtime_dir), server_id],
                         cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture()
def api_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(pm.RUNTIME_DIR_ENV, str(tmp_path / "api-node"))
    path, _ = prepare_runtime_dir()
    return path


def _server_id(api_dir: Path) -> str:
    return (api_dir / pm.SERVER_ID_FILE).read_text()


def _scrape(api_dir: Path, remote: RemoteWorkers) -> dict[str, list]:
    reg = CollectorRegistry()
    reg.register(WorkerMetricsCollector(api_dir, remote))
    return {f.name: f.samples for f in text_string_to_metric_families(generate_latest(reg).decode())}


def test_each_start_gets_a_new_server_id(api_dir: Path) -> None:
    first = _server_id(api_dir)
    assert len(first) == 32 and prepare_runtime_dir()[0] == api_dir and _server_id(api_dir) != first


def test_a_worker_here_answers_none_one_elsewhere_its_series(api_dir: Path, tmp_path: Path) -> None:
    assert _worker(0, api_dir, _server_id(api_dir)) is None  # the API process reads its files
    other_node = tmp_path / "other-node" / "runtime"  # missing: the worker creates it
    report = _worker(1, other_node, _server_id(api_dir))
    assert report is not None and report["node"] and report["pid"] > 0
    assert any(other_node.glob(f"*_{report['pid']}.db"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(report)) == report  # as vLLM carries it
    names = {f["name"] for f in report["families"]}
    assert {pm.WORKER_INFO, pm.LAUNCHES, pm.JIT_COMPILES, pm.KERNEL_INFO} <= names
    assert all(n.startswith(pm.PREFIX) for n in names)
    assert _worker(2, other_node, "another-server") is not None  # an id that is not this dir's


def test_metrics_and_version_combine_this_nodes_files_with_reports(api_dir: Path, tmp_path: Path) -> None:
    server_id = _server_id(api_dir)
    assert _worker(0, api_dir, server_id) is None
    remote = RemoteWorkers(api_dir)
    remote.reports = [_worker(r, tmp_path / f"node-{r}", server_id) for r in (1, 2)]
    fams = _scrape(api_dir, remote)
    ranks = sorted(s.labels["rank"] for s in fams[pm.WORKER_INFO])
    assert ranks == ["0", "1", "2"]
    launches = {s.labels["path"]: s.value for s in fams[pm.LAUNCHES] if s.name.endswith("_total")}
    assert launches == {"optimized": 6, "routed_to_vllm": 0, "fallback": 3}  # summed over 3 workers
    assert {s.labels["phase"]: s.value for s in fams[pm.WORKERS_REPORTING]} == {"serving": 3}  # 'sum' gauge
    assert [s.value for s in fams[pm.KERNEL_INFO]] == [1.0]  # 'max' gauge: one series, not 3
    serving = {s.labels["rank"]: s.value for s in fams[pm.JIT_COMPILES]
               if s.name.endswith("_total") and s.labels["phase"] == "serving"}
    assert serving == {"0": 0, "1": 1, "2": 2}
    summary = workers_summary(api_dir, remote)
    assert [w["rank"] for w in summary["workers"]] == [0, 1, 2]
    assert [w["pid"] for w in summary["workers"][1:]] == [r["pid"] for r in remote.reports]
    assert all(w["moe_calls"]["optimized"] == 2 and w["phase"] == "serving" for w in summary["workers"])
    assert summary["jit_compiles"] == {"fused_moe_kernel|serving": 3, "fused_moe_kernel|warmup": 9}
    assert _scrape(api_dir, RemoteWorkers(api_dir))[pm.WORKERS_REPORTING][0].value == 1  # without reports


def _engine(backend: str, answers: Any) -> SimpleNamespace:
    calls: list[tuple] = []

    async def collective_rpc(method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> Any:
        calls.append((method, args))
        if isinstance(answers, Exception):
            raise answers
        return answers

    parallel = SimpleNamespace(distributed_executor_backend=backend)
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel), collective_rpc=collective_rpc,
                           calls=calls)


def test_refresh_asks_ray_workers_only_and_keeps_the_last_reports(api_dir: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    remote = RemoteWorkers(api_dir)
    report = {"node": "n2", "pid": 7, "families": []}
    mp = _engine("mp", [None, report])
    asyncio.run(remote.refresh(mp))
    asyncio.run(remote.refresh(None))  # engine still starting
    assert mp.calls == [] and remote.reports == []
    ray = _engine("ray", [None, report])
    asyncio.run(remote.refresh(ray))
    assert ray.calls == [(pm.REPORT_METHOD, (remote.server_id,))] and remote.reports == [report]
    broken = _engine("ray", RuntimeError("worker gone"))
    with caplog.at_level(logging.WARNING, logger="moe_serve.service.worker_metrics"):
        asyncio.run(remote.refresh(broken))
        asyncio.run(remote.refresh(broken))
    assert remote.reports == [report]
    assert len([r for r in caplog.records if "did not report" in r.getMessage()]) == 1  # once, not per scrape
