"""What a vLLM worker's plugin reports, as prometheus-client metrics in multiprocess mode.

Each worker writes its values into per-process mmap files (``<type>_<pid>.db``) in the runtime
dir the API process created (env ``MOE_SERVE_RUNTIME_DIR``); the API process reads them with
prometheus-client's MultiProcessCollector (service/worker_metrics.py) for ``/metrics`` and
``/version``. Files stay until the server exits, so a restarted worker (new pid) adds to its
rank's counters. Label sets that stop being true (an info gauge's old phase) are set to 0:
multiprocess files cannot delete a series; the API side drops 0-valued ``*_info`` samples.

Multiprocess mode is switched on in the worker process only (``enable_multiprocess``): the API
process keeps its in-memory registry, and vLLM's ``vllm:*`` series stay where vLLM puts them.

Workers on other nodes (vLLM's Ray executor) write the same files into the runtime dir of *their*
node, which the API process cannot read. So every worker also answers vLLM's ``collective_rpc``
under the name ``REPORT_METHOD`` (``worker_report``): given the server id the API process wrote
into its runtime dir (``SERVER_ID_FILE``), a worker whose dir holds that id answers None (the API
reads its files), any other answers its own series as plain data (msgpack-safe: vLLM carries it
from the worker through the engine core to the API process).
"""
from __future__ import annotations

import glob
import os
import socket
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, values
from prometheus_client.multiprocess import MultiProcessCollector

from moe_serve.kernels.plugin import expert_snapshot

RUNTIME_DIR_ENV = "MOE_SERVE_RUNTIME_DIR"
SERVER_ID_FILE = "server-id"  # in the runtime dir: the id of the API process that reads it
REPORT_METHOD = "moe_serve_plugin_report"  # a worker attribute, called through collective_rpc
PREFIX = "moe_serve_"
JIT_COMPILES = "moe_serve_triton_jit_compiles"
JIT_CACHE_LOADS = "moe_serve_triton_jit_cache_loads"
LAUNCHES = "moe_serve_moe_kernel_launches"
FALLBACKS = "moe_serve_moe_kernel_fallbacks"
FUSED_ROUTER = "moe_serve_fused_router_calls"
KERNEL_INFO = "moe_serve_moe_kernel_info"
ROUTING_INFO = "moe_serve_moe_routing_info"
PLAN_INFO = "moe_serve_moe_plan_info"
WORKER_INFO = "moe_serve_vllm_worker_info"
WORKERS_REPORTING = "moe_serve_vllm_workers_reporting"
WARMUP_FAILURES = "moe_serve_plugin_warmup_failures"
WARMUP_SECONDS = "moe_serve_plugin_warmup_seconds"
WARMUP_SHAPES = "moe_serve_plugin_warmup_shapes"
PINS_FAILED = "moe_serve_plugin_vllm_pins_failed"
KERNEL_INFO_LABELS = ("backend", "swap_ab", "dtype", "tp_size", "mode")
WORKER_INFO_LABELS = ("rank", "mode", "phase", "moe_hook", "jit_monitor")  # + pid (gauge mode 'all')
LAUNCH_PATHS = ("optimized", "routed_to_vllm", "fallback")
GAUGE_MODES = {KERNEL_INFO: "max", ROUTING_INFO: "max", PLAN_INFO: "max", WORKER_INFO: "all", WORKERS_REPORTING: "sum",
               WARMUP_SECONDS: "all", WARMUP_SHAPES: "all", PINS_FAILED: "max"}  # how each gauge combines over workers
JIT_FAMILIES = {  # Triton event kind (moe_serve.kernels.plugin.jit_monitor) -> (family, help)
    "compile": (JIT_COMPILES, "Triton JIT compilations in the vLLM workers, per kernel, phase "
                "(warmup|serving) and TP rank (sum over rank for the server)"),
    "cache_load": (JIT_CACHE_LOADS, "Triton kernels loaded from the on-disk cache in the vLLM "
                   "workers, per kernel, phase and TP rank")}


def enable_multiprocess(path: str) -> None:
    """Metrics created from now on in this process write to mmap files in `path`.

    prometheus-client picks its value class from PROMETHEUS_MULTIPROC_DIR when it is first
    imported; a worker imported it long before it knows it is a worker, so set both here (a
    fresh MultiProcessValue also drops files an earlier value class had opened elsewhere)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.MultiProcessValue()


def ensure_runtime_dir(path: str) -> bool:
    """True if `path` is a directory on this node, created if missing (a worker on another node
    than the API process: its files there reach the API process through ``worker_report``)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return True


def worker_report(runtime_dir: str, server_id: str) -> dict[str, Any] | None:
    """This worker's moe_serve_* series for an API process that cannot read its files: None
    when `runtime_dir` is that API process's (its SERVER_ID_FILE holds `server_id`), else
    {"node": host name, "pid": pid, "families": [{"name", "type", "help", "samples":
    [[sample name, labels, value], ...]}, ...], "expert_load": its expert load snapshot or None}
    (prometheus-client's merge of this pid's files; kernels/plugin/expert_snapshot.py)."""
    try:
        with open(os.path.join(runtime_dir, SERVER_ID_FILE)) as f:
            if f.read().strip() == server_id:
                return None
    except OSError:
        pass  # no id file: not the API process's node
    pid = os.getpid()
    files = glob.glob(os.path.join(glob.escape(runtime_dir), f"*_{pid}.db"))
    families = [{"name": fam.name, "type": fam.type, "help": fam.documentation,
                 "samples": [[s.name, dict(s.labels), s.value] for s in fam.samples]}
                for fam in MultiProcessCollector.merge(files, accumulate=True) if fam.name.startswith(PREFIX)]
    return {"node": socket.gethostname(), "pid": pid, "families": families,
            "expert_load": expert_snapshot.as_report(runtime_dir)}


class PluginMetrics:
    """The metrics of one worker process (rank `rank`, plugin mode `mode`). In a worker they
    are in no registry (registry=None): the files are the export, so create them after
    enable_multiprocess(). Given a registry (tests), they are registered there."""

    def __init__(self, rank: Any, mode: str, registry: CollectorRegistry | None = None) -> None:
        self.rank, self.mode = str(rank), mode
        self._jit = {kind: Counter(name, doc, ["kernel", "phase", "rank"], registry=registry)
                     for kind, (name, doc) in JIT_FAMILIES.items()}
        launches = Counter(LAUNCHES, "MoE expert computations seen by the plugin hook in all "
                           "workers (eager calls and CUDA-graph captures; graph replays are not "
                           "seen), by path: optimized = moe-serve kernels, routed_to_vllm = vLLM's "
                           "where the routing table measured it faster, fallback = vLLM's for a "
                           "case ours does not support", ["path"], registry=registry)
        self._launch = {p: launches.labels(p) for p in LAUNCH_PATHS}
        self._router = Counter(FUSED_ROUTER, "MoE router calls (gate GEMM + top-k) served by "
                               "moe-serve's one-launch router (on unless --no-fused-router; eager calls "
                               "and CUDA-graph captures)", registry=registry)
        self._fallbacks = Counter(FALLBACKS, "MoE calls served by vLLM's kernel because ours does "
                                  "not support them, by reason", ["reason"], registry=registry)
        self._kernel_info = Gauge(KERNEL_INFO, "MoE kernel setup reported by the vLLM workers "
                                  "(value 1)", list(KERNEL_INFO_LABELS), registry=registry,
                                  multiprocess_mode=GAUGE_MODES[KERNEL_INFO])
        self._routing = Gauge(ROUTING_INFO, "Backend per M range for each MoE layer shape, from "
                              "the measured routing table (ours = moe-serve kernel, vllm = vLLM's), "
                              "value 1", ["shape", "routing"], registry=registry,
                              multiprocess_mode=GAUGE_MODES[ROUTING_INFO])
        self._plan = Gauge(PLAN_INFO, "Each MoE layer's plan (kernels/plugin/layer_plan.py) in one line: the "
                           "experts' backend per M range, the router, what fails closed; value 1",
                           ["shape", "plan"], registry=registry, multiprocess_mode=GAUGE_MODES[PLAN_INFO])
        self._worker = Gauge(WORKER_INFO, "One series per vLLM worker process that loaded the "
                             "moe-serve plugin (value 1)", list(WORKER_INFO_LABELS), registry=registry,
                             multiprocess_mode=GAUGE_MODES[WORKER_INFO])
        self._reporting = Gauge(WORKERS_REPORTING, "vLLM worker processes whose plugin reports, "
                                "by phase", ["phase"], registry=registry,
                                multiprocess_mode=GAUGE_MODES[WORKERS_REPORTING])
        self._failures = Counter(WARMUP_FAILURES, "Plugin warm-up steps that raised (the worker "
                                 "serves anyway; serving may then compile)", ["rank"],
                                 registry=registry).labels(self.rank)
        self._failures.inc(0)
        self._warm_s = Gauge(WARMUP_SECONDS, "Seconds the plugin spent warming MoE kernels up", ["rank"],
                             registry=registry, multiprocess_mode=GAUGE_MODES[WARMUP_SECONDS]).labels(self.rank)
        self._warm_shapes = Gauge(WARMUP_SHAPES, "MoE layer shapes the plugin warmed up", ["rank"],
                                  registry=registry,
                                  multiprocess_mode=GAUGE_MODES[WARMUP_SHAPES]).labels(self.rank)
        self._pins_failed = Gauge(PINS_FAILED, "Pins on vLLM's internals that failed in this worker's vLLM "
                                  "(0: our MoE kernels may hook in; more: vLLM's kernels serve)", ["rank"],
                                  registry=registry, multiprocess_mode=GAUGE_MODES[PINS_FAILED]).labels(self.rank)
        self._labels: dict[str, tuple[str, ...]] = {}

    def jit(self, kernel: str, phase: str, kind: str, n: int = 1) -> None:
        """n Triton events of `kind` ('compile' | 'cache_load') for kernel in phase."""
        self._jit[kind].labels(kernel, phase, self.rank).inc(n)

    def launch(self, path: str) -> None:
        self._launch[path].inc()

    def router_call(self) -> None:
        self._router.inc()

    def fallback(self, reason: str) -> None:
        self._launch["fallback"].inc()
        self._fallbacks.labels(reason).inc()

    def _set_info(self, key: str, gauge: Gauge, labels: tuple[str, ...]) -> None:
        old = self._labels.get(key)
        if old == labels:
            return
        if old is not None:
            gauge.labels(*old).set(0)
        gauge.labels(*labels).set(1)
        self._labels[key] = labels

    def worker_state(self, phase: str, moe_hook: bool, jit_monitor: bool) -> None:
        self._set_info("worker", self._worker, (self.rank, self.mode, phase,
                                                "installed" if moe_hook else "absent",
                                                str(jit_monitor).lower()))
        self._set_info("phase", self._reporting, (phase,))

    def kernel_info(self, backend: str, swap_ab: str, dtype: str, tp_size: Any) -> None:
        self._set_info("kernel", self._kernel_info, (backend, swap_ab, dtype, str(tp_size), self.mode))

    def routing(self, shape: str, desc: str) -> None:
        self._routing.labels(shape, desc).set(1)

    def plan(self, shape: str, summary: str) -> None:
        self._plan.labels(shape, summary).set(1)

    def pins_failed(self, count: int) -> None:
        self._pins_failed.set(count)

    def warmup_failed(self) -> None:
        self._failures.inc()

    def warmup_done(self, seconds: float, shapes: int) -> None:
        self._warm_s.set(round(seconds, 3))
        self._warm_shapes.set(shapes)
