"""Cross-process export of what each vLLM worker reports (plugin state, MoE launches, Triton
JIT compiles) to the API process's Prometheus registry.

Worker side (``WorkerReport``): one JSON file per process, ``worker-<pid>.json``, in the
directory named by env ``MOE_SERVE_RUNTIME_DIR`` (created by the API process before the engine
starts; workers inherit the env). Written atomically (tmp + rename) on every compile event, on
phase changes and at most every ``FLUSH_INTERVAL_S`` while launch counters move. Files are
never deleted while the server runs, so a restarted worker (new pid) adds to the totals instead
of replacing them.

API side: ``read_reports(dir)`` and ``WorkerCollector``, a prometheus-client custom collector
exporting ``moe_serve_triton_jit_compiles_total{kernel, phase, rank}`` (real compiles, summed
over the worker files of each TP rank), ``moe_serve_triton_jit_cache_loads_total{kernel, phase,
rank}``,
``moe_serve_moe_kernel_launches_total{path}`` and the info gauge
``moe_serve_moe_kernel_info{backend, swap_ab, dtype, tp_size, mode} 1``.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

RUNTIME_DIR_ENV = "MOE_SERVE_RUNTIME_DIR"
FLUSH_INTERVAL_S = 1.0
_PREFIX = "worker-"


# ----------------------------------------------------------------------------- API side

def prepare_runtime_dir() -> Path:
    """The API process's runtime dir: $MOE_SERVE_RUNTIME_DIR (stale worker files of an earlier
    server removed) or a fresh temp dir; exported in the env so workers inherit it."""
    given = os.environ.get(RUNTIME_DIR_ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob(_PREFIX + "*.json"):
            old.unlink(missing_ok=True)
    else:
        path = Path(tempfile.mkdtemp(prefix="moe-serve-runtime-"))
    os.environ[RUNTIME_DIR_ENV] = str(path)
    return path


def read_reports(runtime_dir: str | Path) -> list[dict[str, Any]]:
    """Every worker report in the dir (unreadable/partial files skipped), ordered by rank, pid."""
    out = []
    for f in Path(runtime_dir).glob(_PREFIX + "*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: (r.get("rank") if r.get("rank") is not None else 1 << 30,
                                      r.get("pid", 0)))


def jit_totals(reports: Iterable[dict[str, Any]], kind: str = "compile") -> Counter:
    """{(kernel, phase): count} of one event kind, summed over reports."""
    tot: Counter = Counter()
    for r in reports:
        for e in r.get("jit", []):
            if e.get("kind") == kind:
                tot[(e["kernel"], e["phase"])] += int(e["count"])
    return tot


def _compile_map(reports: Iterable[dict[str, Any]]) -> dict[str, int]:
    """{"kernel|phase": compiles} summed over reports (JSON-friendly keys)."""
    return {f"{k}|{p}": v for (k, p), v in sorted(jit_totals(reports).items())}


def summary(runtime_dir: str | Path) -> dict[str, Any]:
    """Compact JSON view of the workers, each with its own compile counts, and their totals
    (for /version and scripts)."""
    reps = read_reports(runtime_dir)
    keys = ("pid", "rank", "mode", "plugin_loaded", "hooks", "phase", "moe_calls", "fallback_reasons",
            "kernel_info", "warmup", "jit_monitor")
    return {
        "workers": [{**{k: r.get(k) for k in keys}, "jit_compiles": _compile_map([r])} for r in reps],
        "jit_compiles": _compile_map(reps),
    }


class WorkerCollector:
    """prometheus-client custom collector reading the worker files at scrape time."""

    def __init__(self, runtime_dir: str | Path) -> None:
        self.runtime_dir = Path(runtime_dir)

    def describe(self) -> list:
        return []  # metrics are known only at scrape time; avoid a collect() at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reps = read_reports(self.runtime_dir)
        for name, kind, doc in (
            ("moe_serve_triton_jit_compiles", "compile",
             "Triton JIT compilations in the vLLM workers, per kernel, phase (warmup|serving) and "
             "TP rank (sum over rank for the server)"),
            ("moe_serve_triton_jit_cache_loads", "cache_load",
             "Triton kernels loaded from the on-disk cache in the vLLM workers, per kernel, phase "
             "and TP rank"),
        ):
            fam = CounterMetricFamily(name, doc, labels=["kernel", "phase", "rank"])
            per_rank: Counter = Counter()
            for r in reps:  # a restarted worker (new pid, same rank) adds to its rank's series
                for (kernel, phase), v in jit_totals([r], kind).items():
                    per_rank[(kernel, phase, str(r.get("rank")))] += v
            for labels, v in sorted(per_rank.items()):
                fam.add_metric(list(labels), v)
            yield fam
        calls = CounterMetricFamily("moe_serve_moe_kernel_launches",
                                    "MoE expert computations seen by the plugin hook in all workers "
                                    "(eager calls and CUDA-graph captures; graph replays are not seen), "
                                    "by path (optimized = moe-serve kernels, routed_to_vllm = vLLM's "
                                    "where the routing table measured it faster, fallback = vLLM's "
                                    "for a case ours does not support)",
                                    labels=["path"])
        tot: Counter = Counter()
        for r in reps:
            tot.update({k: int(v) for k, v in (r.get("moe_calls") or {}).items()})
        for path in sorted(set(tot) | {"optimized", "fallback"}):
            calls.add_metric([path], tot[path])
        yield calls
        info = GaugeMetricFamily("moe_serve_moe_kernel_info",
                                 "MoE kernel setup reported by the vLLM workers (value 1)",
                                 labels=["backend", "swap_ab", "dtype", "tp_size", "mode"])
        seen = set()
        for r in reps:
            ki = r.get("kernel_info") or {}
            labels = tuple(str(ki.get(k, "unknown")) for k in ("backend", "swap_ab", "dtype", "tp_size"))
            labels += (str(r.get("mode", "unknown")),)
            if labels not in seen:
                seen.add(labels)
                info.add_metric(list(labels), 1)
        yield info
        rinfo = GaugeMetricFamily("moe_serve_moe_routing_info",
                                  "Backend per M range for each MoE layer shape, from the measured "
                                  "routing table (ours = moe-serve kernel, vllm = vLLM's), value 1",
                                  labels=["shape", "routing"])
        seen_r = set()
        for r in reps:
            for shape, desc in sorted(((r.get("kernel_info") or {}).get("routing") or {}).items()):
                if (shape, str(desc)) not in seen_r:
                    seen_r.add((shape, str(desc)))
                    rinfo.add_metric([shape, str(desc)], 1)
        yield rinfo
        winfo = GaugeMetricFamily("moe_serve_vllm_worker_info",
                                  "One series per vLLM worker process that loaded the moe-serve plugin (value 1)",
                                  labels=["pid", "rank", "mode", "phase", "moe_hook", "jit_monitor"])
        for r in reps:
            hook = "installed" if any(h.endswith(".apply") for h in r.get("hooks") or []) else "absent"
            winfo.add_metric([str(r.get("pid")), str(r.get("rank")), str(r.get("mode")), str(r.get("phase")),
                              hook, str(bool(r.get("jit_monitor"))).lower()], 1)
        yield winfo
        workers = GaugeMetricFamily("moe_serve_vllm_workers_reporting",
                                    "vLLM worker processes whose plugin report is present, by state",
                                    labels=["phase"])
        by_phase = Counter(str(r.get("phase")) for r in reps)
        for ph in sorted(by_phase):
            workers.add_metric([ph], by_phase[ph])
        yield workers


# ----------------------------------------------------------------------------- worker side

class WorkerReport:
    """What this process reports; `save()` writes it atomically, `touch()` marks it dirty and
    a daemon thread flushes dirty state every FLUSH_INTERVAL_S."""

    def __init__(self, runtime_dir: str | Path | None, **fields: Any) -> None:
        self.dir = Path(runtime_dir) if runtime_dir else None
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {"pid": os.getpid(), "rank": None, "local_rank": None,
                                     "moe_calls": {}, "fallback_reasons": {}, "jit": [],
                                     "kernel_info": {}, **fields}
        self._dirty = False
        self._thread: threading.Thread | None = None

    def set_dir(self, runtime_dir: str | Path | None) -> None:
        """Start writing to runtime_dir (None: keep the report in memory only)."""
        self.dir = Path(runtime_dir) if runtime_dir else None

    @property
    def path(self) -> Path | None:
        return None if self.dir is None else self.dir / f"{_PREFIX}{os.getpid()}.json"

    def update(self, **fields: Any) -> None:
        with self.lock:
            self.data.update(fields)
        self.save()

    def count(self, bucket: str, key: str, n: int = 1) -> None:
        """Increment data[bucket][key] (cheap; flushed later by the thread)."""
        with self.lock:
            b = self.data.setdefault(bucket, {})
            b[key] = b.get(key, 0) + n
            self._dirty = True
        self._ensure_thread()

    def set_jit(self, snapshot: dict[tuple[str, str, str], int]) -> None:
        with self.lock:
            self.data["jit"] = [{"kernel": k, "phase": p, "kind": kd, "count": c}
                                for (k, p, kd), c in sorted(snapshot.items())]
        self.save()

    def save(self) -> None:
        """Atomic write; never raises (reporting must not break serving)."""
        path = self.path
        if path is None:
            return
        try:
            with self.lock:
                self.data["updated"] = time.time()
                text = json.dumps(self.data, default=str)
                self._dirty = False
            tmp = path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_text(text)
            os.replace(tmp, path)
        except Exception:  # noqa: BLE001
            pass

    def _ensure_thread(self) -> None:
        if self._thread is None and self.dir is not None:
            self._thread = threading.Thread(target=self._loop, name="moe-serve-report", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            if self._dirty:
                self.save()
