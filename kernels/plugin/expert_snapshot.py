"""Expert load snapshots: what a worker writes of its expert counts, how often, and how they read.

A worker that counts its expert load (kernels/plugin/expert_load.py) starts a SnapshotWriter when
it begins serving. Every INTERVAL_S it reads its counts (a host copy off the decode path: the
reader is given) and writes them into the runtime dir as ``expert-load-<pid>.npz`` (replaced
atomically):

- ``total`` int64 [L, W]: tokens routed to each (logical) expert of each MoE layer since serving
  began, in a layer's first E columns, and in column E the routing ids that named none of its
  experts (W > every layer's E; the columns past that stay 0),
- ``window`` int64 [L, W]: the same over the last ``window_s`` seconds (the newest snapshot minus
  the one at or just before the window's start, so up to INTERVAL_S more; since serving began
  while that is younger than the window),
- ``meta``: JSON (rank, pid, node, time of the snapshot, serving start, window span, and per layer
  its name, number in the model, experts and top-k).

``POST /v1/moe/expert-load/reset`` asks each worker for a snapshot now (SNAPSHOT_RPC, a worker
method called over vLLM's collective_rpc: SnapshotWriter.snapshot_now).

The API process reads these files (read_snapshots; workers on other nodes send the same content
through the metrics report, as_report) and merges them (service/expert_load.py). Plain numpy:
no torch here, so the load test can use `load_summary` too.
"""
from __future__ import annotations

import glob
import io
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from moe_serve.kernels.config import current

INTERVAL_S = 1.0            # seconds between a worker's snapshots
DEFAULT_WINDOW_S = 60.0     # the sliding window's length
LOGGER = "vllm.moe_serve_plugin"   # the plugin's logger (moe_serve.kernels.plugin.vllm_plugin.MoePlugin)
PREFIX = "expert-load-"
SNAPSHOT_RPC = "moe_serve_expert_load_now"   # a worker method: collective_rpc(SNAPSHOT_RPC) -> as_report's data
SUFFIX = ".npz"


def snapshot_path(runtime_dir: str, pid: int) -> str:
    return os.path.join(runtime_dir, f"{PREFIX}{pid}{SUFFIX}")


def window_from_env() -> float:
    """The window's length in seconds: the expert_stats_window_s setting (kernels/config.py; env
    $MOE_SERVE_EXPERT_STATS_WINDOW, validated > 0 where the config is built)."""
    return current().expert_stats_window_s


@dataclass(frozen=True)
class LayerInfo:
    """One counted MoE layer: vLLM's layer name, its number in the model, experts, top-k."""

    name: str
    layer: int
    experts: int
    top_k: int


def load_summary(counts: list[int] | np.ndarray, top_k: int) -> dict[str, Any]:
    """One layer's load (tokens per expert, [E]) in three numbers: routed = tokens x top-k
    routed (the sum), imbalance = the busiest expert's load over the mean (1 = uniform; None
    without tokens), idle_experts = experts that got no token."""
    c = np.asarray(counts, dtype=np.int64)
    routed = int(c.sum())
    return {"routed": routed, "tokens": routed // max(top_k, 1),
            "imbalance": round(float(c.max()) * c.size / routed, 4) if routed else None,
            "idle_experts": int((c == 0).sum())}


class SnapshotWriter:
    """The thread that snapshots one worker's counts every INTERVAL_S into its file.

    read() returns the counts now (int64 [L, E], a copy the writer may keep); restart() (serving
    begins again, counts zeroed) drops the history, under the lock the caller zeroes under."""

    def __init__(self, runtime_dir: str, read: Callable[[], np.ndarray], layers: list[LayerInfo],
                 rank: int | None, window_s: float, lock: threading.Lock) -> None:
        self.path = snapshot_path(runtime_dir, os.getpid())
        self.read = read
        self.window_s = window_s
        self.lock = lock
        self._meta = {"rank": rank, "pid": os.getpid(), "node": socket.gethostname(),
                      "layers": [vars(layer) for layer in layers]}
        self._history: deque[tuple[float, np.ndarray]] = deque()
        self._since = time.time()
        self._thread: threading.Thread | None = None

    def restart(self) -> None:
        """Counting begins again now (call with `lock` held, after zeroing); the first snapshot
        is written at once, then every INTERVAL_S."""
        self._history.clear()
        self._since = time.time()
        self._write_locked()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moe-serve-expert-load", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        failing = False
        while True:
            time.sleep(INTERVAL_S)
            try:
                with self.lock:
                    self._write_locked()
                failing = False
            except Exception as exc:  # noqa: BLE001 - skipped (the file's time says how old it is); retried
                if not failing:
                    logging.getLogger(LOGGER).warning("moe-serve expert load: snapshot failed, retrying every "
                                                      "%.0f s: %r", INTERVAL_S, exc)
                failing = True

    def snapshot_now(self) -> dict[str, Any]:
        """Write a snapshot now and return it as as_report's data (the counts read now)."""
        with self.lock:
            return self._write_locked()

    def _write_locked(self) -> dict[str, Any]:
        """Write the snapshot of the counts now; returned as as_report's data."""
        now, total = time.time(), self.read()
        self._history.append((now, total))
        while len(self._history) > 1 and self._history[1][0] <= now - self.window_s:
            self._history.popleft()
        start, base = self._history[0]
        if start > now - self.window_s:        # serving is younger than the window: since its start
            start, base = self._since, np.zeros_like(total)
        meta = {**self._meta, "time": now, "serving_since": self._since, "window_s": self.window_s,
                "window_span_s": round(now - start, 3)}
        buf = io.BytesIO()
        np.savez(buf, total=total, window=total - base, meta=np.array(json.dumps(meta)))
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
        os.replace(tmp, self.path)
        return {"meta": meta, "total": total.tolist(), "window": (total - base).tolist()}


def read_snapshot(path: str) -> dict[str, Any] | None:
    """{"meta": {...}, "total": int64 [L, E], "window": int64 [L, E]} of one file, None if it
    cannot be read (removed meanwhile, or written by another version)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {"meta": json.loads(str(z["meta"])), "total": z["total"], "window": z["window"]}
    except (OSError, KeyError, ValueError):
        return None


def read_snapshots(runtime_dir: str) -> list[dict[str, Any]]:
    """Every worker's latest snapshot in `runtime_dir` (this node's workers)."""
    paths = glob.glob(os.path.join(glob.escape(runtime_dir), f"{PREFIX}*{SUFFIX}"))
    return [s for s in map(read_snapshot, sorted(paths)) if s is not None]


def as_report(runtime_dir: str) -> dict[str, Any] | None:
    """This process's snapshot as plain data (lists; msgpack-safe for vLLM's collective_rpc), for
    an API process on another node; None when this worker writes none."""
    snap = read_snapshot(snapshot_path(runtime_dir, os.getpid()))
    if snap is None:
        return None
    return {"meta": snap["meta"], "total": snap["total"].tolist(), "window": snap["window"].tolist()}


def from_report(report: dict[str, Any]) -> dict[str, Any]:
    """as_report's data back as a snapshot (arrays)."""
    return {"meta": report["meta"], "total": np.asarray(report["total"], dtype=np.int64),
            "window": np.asarray(report["window"], dtype=np.int64)}


def remove_snapshots(runtime_dir: str) -> None:
    """Remove the snapshot files an earlier server left in `runtime_dir`."""
    for path in glob.glob(os.path.join(glob.escape(runtime_dir), f"{PREFIX}*")):
        try:
            os.unlink(path)
        except OSError:
            pass
