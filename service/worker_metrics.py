"""The API process's view of the vLLM workers' plugin metrics (kernels/plugin/plugin_metrics.py).

Workers write prometheus-client multiprocess files into the runtime dir; here they are read
with prometheus-client's MultiProcessCollector: summed per series for ``/metrics``
(``WorkerMetricsCollector``), and file by file, one pid at a time, for ``/version``'s
per-worker details (``workers_summary``). Only ``moe_serve_*`` families are exported: whatever
vLLM itself records inside a worker lands in the same files and stays out (vLLM's ``vllm:*``
series come from the API process, through service.metrics.DefaultRegistryBridge).
"""
from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

from kernels.plugin import plugin_metrics as pm


def prepare_runtime_dir() -> tuple[Path, bool]:
    """(dir, created): $MOE_SERVE_RUNTIME_DIR with an earlier server's files removed, or a fresh
    temp dir (created=True: remove it at exit); exported in the env so workers inherit it."""
    given = os.environ.get(pm.RUNTIME_DIR_ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("*.db"):
            old.unlink(missing_ok=True)
    else:
        path = Path(tempfile.mkdtemp(prefix="moe-serve-runtime-"))
    os.environ[pm.RUNTIME_DIR_ENV] = str(path)
    return path, not given


def _families(files: list[str]) -> Iterator[Any]:
    """Our families merged over `files`; 0-valued samples of info gauges dropped."""
    for fam in MultiProcessCollector.merge(files, accumulate=True):
        if not fam.name.startswith(pm.PREFIX):
            continue
        if fam.name.endswith("_info"):
            fam.samples = [s for s in fam.samples if s.value]
        yield fam


class WorkerMetricsCollector:
    """Registered in the API registry: every worker's moe_serve_* series, read at scrape time."""

    def __init__(self, runtime_dir: str | Path) -> None:
        self.runtime_dir = Path(runtime_dir)

    def describe(self) -> list:
        return []  # known only at scrape time

    def collect(self) -> Iterator[Any]:
        yield from _families([str(f) for f in self.runtime_dir.glob("*.db")])


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
    w["moe_calls"] = totals(pm.LAUNCHES, "path")
    w["fallback_reasons"] = totals(pm.FALLBACKS, "reason")
    w["kernel_info"] = {**{k: v for k, v in kinfo.items() if k != "mode"}, "routing": routes}
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


def workers_summary(runtime_dir: str | Path) -> dict[str, Any]:
    """{"workers": [one dict per worker process, by rank and pid], "jit_compiles": totals}."""
    per_pid = {pid: _samples(files) for pid, files in _by_pid(Path(runtime_dir)).items()}
    workers = [w for pid, fams in per_pid.items() if (w := _one_worker(pid, fams)) is not None]
    workers.sort(key=lambda w: (w["rank"] if w["rank"] is not None else 1 << 30, w["pid"]))
    return {"workers": workers, "jit_compiles": _compile_map(list(per_pid.values()))}
