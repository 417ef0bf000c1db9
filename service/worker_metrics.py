"""The API process's view of the vLLM workers' plugin metrics (kernels/plugin/plugin_metrics.py).

Workers write prometheus-client multiprocess files into the runtime dir; here they are read
with prometheus-client's MultiProcessCollector: summed per series for ``/metrics``
(``WorkerMetricsCollector``), and file by file, one pid at a time, for ``/version``'s
per-worker details (``workers_summary``). Only ``moe_serve_*`` families are exported: whatever
vLLM itself records inside a worker lands in the same files and stays out (vLLM's ``vllm:*``
series come from the API process, through moe_serve.service.metrics.DefaultRegistryBridge).

Workers on other nodes (vLLM's Ray executor) write their files on their own node: with the Ray
executor, ``RemoteWorkers.refresh`` asks every worker over vLLM's ``collective_rpc`` (at scrape
time, before ``/metrics`` and ``/version`` answer) and those whose files are not here answer with
their series (moe_serve.kernels.plugin.plugin_metrics.worker_report); they are combined with the local
files' series as prometheus-client combines files (counters summed, gauges by their mode).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

from moe_serve.kernels.plugin import expert_snapshot
from moe_serve.kernels.plugin import plugin_metrics as pm

logger = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 5.0  # a scrape waits this long for the workers on other nodes, then uses their last report


def prepare_runtime_dir() -> tuple[Path, bool]:
    """(dir, created): $MOE_SERVE_RUNTIME_DIR with an earlier server's files (metrics, expert load
    snapshots) removed, or a fresh temp dir (created=True: remove it at exit); exported in the env
    so workers inherit it. A new
    server id in it (pm.SERVER_ID_FILE) tells the workers on this node from those on others."""
    given = os.environ.get(pm.RUNTIME_DIR_ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("*.db"):
            old.unlink(missing_ok=True)
        expert_snapshot.remove_snapshots(str(path))
    else:
        path = Path(tempfile.mkdtemp(prefix="moe-serve-runtime-"))
    (path / pm.SERVER_ID_FILE).write_text(uuid.uuid4().hex)
    os.environ[pm.RUNTIME_DIR_ENV] = str(path)
    return path, not given


def _filtered(fams: Iterable[Any]) -> Iterator[Any]:
    """Our families only; 0-valued samples of info gauges dropped."""
    for fam in fams:
        if not fam.name.startswith(pm.PREFIX):
            continue
        if fam.name.endswith("_info"):
            fam.samples = [s for s in fam.samples if s.value]
        yield fam


JIT_PHASES = ("warmup", "serving")  # kernels.jit_monitor's phases


def _with_zero_phases(families: list[Any]) -> list[Any]:
    """The Triton JIT families with a 0 sample (empty kernel and rank labels) for each phase no
    worker has counted yet, so a phase's series exists before its first compile (and on a CPU,
    where nothing compiles): dashboards and alerts see 0, not an absent series."""
    by_name = {fam.name: fam for fam in families}
    for name, doc in pm.JIT_FAMILIES.values():
        fam = by_name.get(name)
        if fam is None:
            fam = CounterMetricFamily(name, doc, labels=["kernel", "phase", "rank"])
            families.append(fam)
        seen = {s.labels.get("phase") for s in fam.samples}
        for phase in JIT_PHASES:
            if phase not in seen:
                fam.samples.append(Sample(name + "_total", {"kernel": "", "phase": phase, "rank": ""}, 0.0))
    return families


def _families(files: list[str]) -> Iterator[Any]:
    """Our families merged over `files`; 0-valued samples of info gauges dropped."""
    return _filtered(MultiProcessCollector.merge(files, accumulate=True))


def _report_families(report: dict[str, Any]) -> list[Metric]:
    """A worker_report's families as prometheus-client Metrics."""
    fams = []
    for f in report["families"]:
        fam = Metric(f["name"], f["help"], f["type"])
        fam.samples = [Sample(name, labels, value) for name, labels, value in f["samples"]]
        fams.append(fam)
    return list(_filtered(fams))


def combine(families: Iterable[Any]) -> list[Metric]:
    """Families of several workers (or sets of files) as one: counter samples summed, gauge
    samples by the gauge's multiprocess mode (pm.GAUGE_MODES: max, sum, or all = kept apart)."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = defaultdict(dict)
    for fam in families:
        merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
        mode = pm.GAUGE_MODES.get(fam.name, "all") if fam.type == "gauge" else "sum"
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            old = values[fam.name].get(key)
            if old is None or mode == "all":
                values[fam.name][key] = s.value
            else:
                values[fam.name][key] = max(old, s.value) if mode == "max" else old + s.value
    for name, fam in merged.items():
        fam.samples = [Sample(sname, dict(labels), v) for (sname, labels), v in values[name].items()]
    return list(merged.values())


class RemoteWorkers:
    """The last reports of the workers whose files are on other nodes (pm.worker_report)."""

    def __init__(self, runtime_dir: str | Path) -> None:
        self.server_id = (Path(runtime_dir) / pm.SERVER_ID_FILE).read_text().strip()
        self.reports: list[dict[str, Any]] = []
        self._lock = asyncio.Lock()
        self._failing = False

    async def refresh(self, engine: Any) -> None:
        """Ask every worker of `engine` (vLLM's AsyncLLM; None while it starts) over collective_rpc,
        with vLLM's Ray executor only (other executors run every worker on this node). A failed or
        late answer keeps the last reports (logged once until an answer comes again)."""
        if engine is None or engine.vllm_config.parallel_config.distributed_executor_backend != "ray":
            return
        async with self._lock:
            try:
                answers = await asyncio.wait_for(
                    engine.collective_rpc(pm.REPORT_METHOD, timeout=REPORT_TIMEOUT_S, args=(self.server_id,)),
                    REPORT_TIMEOUT_S + 1)
            except Exception as exc:  # noqa: BLE001 - a scrape must answer with what it has
                if not self._failing:
                    logger.warning("workers on other nodes did not report (%r); serving their last "
                                   "reports until they do", exc)
                self._failing = True
                return
            self._failing = False
            self.reports = [a for a in answers if a]


class WorkerMetricsCollector:
    """Registered in the API registry: every worker's moe_serve_* series, read at scrape time
    (this node's files, and the last reports of workers on other nodes)."""

    def __init__(self, runtime_dir: str | Path, remote: RemoteWorkers | None = None) -> None:
        self.runtime_dir = Path(runtime_dir)
        self.remote = remote

    def describe(self) -> list:
        return []  # known only at scrape time

    def collect(self) -> Iterator[Any]:
        local = list(_families([str(f) for f in self.runtime_dir.glob("*.db")]))
        reports = self.remote.reports if self.remote is not None else []
        if reports:
            local = combine([*local, *(fam for r in reports for fam in _report_families(r))])
        yield from _with_zero_phases(local)


def _by_pid(runtime_dir: Path) -> dict[str, list[str]]:
    files: dict[str, list[str]] = defaultdict(list)
    for f in runtime_dir.glob("*.db"):
        files[f.stem.rsplit("_", 1)[-1]].append(str(f))
    return files


def _samples(files: list[str]) -> dict[str, list[Sample]]:
    return {fam.name: fam.samples for fam in _families(files)}


def _one_worker(pid: str, fams: dict[str, list[Sample]]) -> dict[str, Any] | None:
    info = [s.labels for s in fams.get(pm.WORKER_INFO, [])]
    if not info:
        return None  # not a worker that loaded the plugin (another process of the group)
    w: dict[str, Any] = {"pid": int(pid), **{k: info[0][k] for k in pm.WORKER_INFO_LABELS}}
    w["rank"] = int(w["rank"]) if w["rank"].isdigit() else None

    def totals(name: str, label: str) -> dict[str, int]:
        return {s.labels[label]: int(s.value) for s in fams.get(name, []) if s.name.endswith("_total")}

    kinfo = next((s.labels for s in fams.get(pm.KERNEL_INFO, [])), {})
    routes = {s.labels["shape"]: s.labels["routing"] for s in fams.get(pm.ROUTING_INFO, [])}
    plans = {s.labels["shape"]: s.labels["plan"] for s in fams.get(pm.PLAN_INFO, [])}
    w["moe_calls"] = totals(pm.LAUNCHES, "path")
    w["fallback_reasons"] = totals(pm.FALLBACKS, "reason")
    w["kernel_info"] = {**{k: v for k, v in kinfo.items() if k != "mode"}, "routing": routes, "plans": plans}
    gauge = {name: next((s.value for s in fams.get(name, [])), 0.0)
             for name in (pm.WARMUP_SECONDS, pm.WARMUP_SHAPES)}
    w["warmup"] = {"seconds": gauge[pm.WARMUP_SECONDS], "shapes": int(gauge[pm.WARMUP_SHAPES]),
                   "failures": sum(totals(pm.WARMUP_FAILURES, "rank").values())}
    w["jit_compiles"] = _compile_map([fams])
    return w


def _compile_map(per_worker: list[dict[str, list[Sample]]]) -> dict[str, int]:
    """{"kernel|phase": compiles} summed over workers."""
    out: dict[str, int] = defaultdict(int)
    for fams in per_worker:
        for s in fams.get(pm.JIT_COMPILES, []):
            if s.name.endswith("_total"):
                out[f"{s.labels['kernel']}|{s.labels['phase']}"] += int(s.value)
    return dict(sorted(out.items()))


def workers_summary(runtime_dir: str | Path, remote: RemoteWorkers | None = None) -> dict[str, Any]:
    """{"workers": [one dict per worker process (node, pid, rank, ...), by rank and pid],
    "jit_compiles": totals}: this node's files and the last reports of workers on other nodes."""
    here = socket.gethostname()
    per_worker = [(here, pid, _samples(files)) for pid, files in _by_pid(Path(runtime_dir)).items()]
    per_worker += [(r["node"], str(r["pid"]), {fam.name: fam.samples for fam in _report_families(r)})
                   for r in (remote.reports if remote is not None else [])]
    workers = [{"node": node, **w} for node, pid, fams in per_worker if (w := _one_worker(pid, fams)) is not None]
    workers.sort(key=lambda w: (w["rank"] if w["rank"] is not None else 1 << 30, w["pid"]))
    return {"workers": workers, "jit_compiles": _compile_map([fams for _, _, fams in per_worker])}
