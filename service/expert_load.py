"""The workers' expert load in the API process: their snapshots merged, and the views of it.

Sources: this node's snapshot files in the runtime dir and the last reports of workers on other
nodes (kernels/plugin/expert_snapshot.py; service/worker_metrics.RemoteWorkers), read when asked
(a scrape, the JSON endpoint). Merge: tensor-parallel ranks route the same tokens with the same
replicated gate, so each holds the same counts; pipeline stages hold different layers. Per layer,
the merged counts are the element-wise max over the workers that count it: any one TP rank's, each
stage's own layers. (moe-serve runs one engine: no data-parallel ranks whose tokens would add.)

Three views of each layer's tokens per expert [E]:
- ``total``: since serving began (warm-up excluded: kernels/plugin/expert_load.py); the Prometheus
  counter's source, never reset.
- ``window``: the last ``window_s`` seconds (each worker's newest snapshot minus its snapshot at or
  just before the window's start; snapshots every second, so it spans up to a second more:
  ``window_span_s``). Imbalance, idle experts and the load spread in Prometheus
  are the window's.
- ``since_reset``: since the last ``POST /v1/moe/expert-load/reset`` (`reset`), or ``total`` if none
  since serving began. A reset changes nothing else.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernels.plugin import expert_snapshot as es
from service.worker_metrics import RemoteWorkers


@dataclass
class MergedLoad:
    """Every worker's snapshot as one: layers by their number in the model."""

    layers: list[es.LayerInfo]
    total: np.ndarray               # [L, E_max] int64
    window: np.ndarray              # [L, E_max] int64
    as_of: float                    # unix time of the oldest snapshot merged
    serving_since: float            # unix time serving (re)started, the latest over workers
    window_s: float                 # the window's configured length
    window_span_s: float            # what it covers now (shorter while serving is younger)
    workers: int


def merge(snapshots: list[dict[str, Any]]) -> MergedLoad | None:
    """The snapshots of all workers (expert_snapshot.read_snapshot's form) merged; None if none."""
    if not snapshots:
        return None
    rows: dict[str, tuple[es.LayerInfo, np.ndarray, np.ndarray]] = {}
    for snap in snapshots:
        for i, layer in enumerate(snap["meta"]["layers"]):
            info = es.LayerInfo(**layer)
            total, window = snap["total"][i, :info.experts], snap["window"][i, :info.experts]
            if info.name in rows:
                _, t, w = rows[info.name]
                total, window = np.maximum(t, total), np.maximum(w, window)
            rows[info.name] = (info, total, window)
    ordered = sorted(rows.values(), key=lambda r: (r[0].layer, r[0].name))
    width = max(info.experts for info, _, _ in ordered)
    pad = lambda a: np.pad(a, (0, width - a.size))  # noqa: E731 - rows of layers with fewer experts
    metas = [s["meta"] for s in snapshots]
    return MergedLoad(layers=[r[0] for r in ordered], total=np.stack([pad(r[1]) for r in ordered]),
                      window=np.stack([pad(r[2]) for r in ordered]), as_of=min(m["time"] for m in metas),
                      serving_since=max(m["serving_since"] for m in metas), window_s=metas[0]["window_s"],
                      window_span_s=min(m["window_span_s"] for m in metas), workers=len(snapshots))


@dataclass
class ExpertLoadSource:
    """Reads and merges the workers' snapshots; holds the JSON view's reset point."""

    runtime_dir: Path
    remote: RemoteWorkers | None = None
    reset_at: float | None = None
    _baseline: dict[str, np.ndarray] = field(default_factory=dict)   # layer name -> total at reset

    def merged(self) -> MergedLoad | None:
        snaps = es.read_snapshots(str(self.runtime_dir))
        if self.remote is not None:
            snaps += [es.from_report(r["expert_load"]) for r in self.remote.reports if r.get("expert_load")]
        return merge(snaps)

    def reset(self) -> None:
        """Counting for `since_reset` begins now."""
        load = self.merged()
        self.reset_at = time.time()
        self._baseline = {} if load is None else \
            {info.name: load.total[i, :info.experts].copy() for i, info in enumerate(load.layers)}

    def since_reset(self, load: MergedLoad, row: int) -> np.ndarray:
        """Layer `row`'s tokens per expert since the reset ([E])."""
        info = load.layers[row]
        total = load.total[row, :info.experts]
        base = self._baseline.get(info.name)
        if base is None or self.reset_at is None or load.serving_since > self.reset_at:
            return total
        return np.maximum(total - base, 0)

    def body(self) -> dict[str, Any]:
        """The JSON view (GET /v1/moe/expert-load): per layer its three views and their summaries."""
        load = self.merged()
        head = {"object": "moe.expert_load", "reset_at": self.reset_at, "views": list(VIEWS)}
        if load is None:
            return {**head, "as_of": None, "serving_since": None, "window_s": None, "window_span_s": None,
                    "workers": 0, "layers": []}
        layers = []
        for i, info in enumerate(load.layers):
            views = {"total": load.total[i, :info.experts], "window": load.window[i, :info.experts],
                     "since_reset": self.since_reset(load, i)}
            layers.append({"layer": info.layer, "name": info.name, "experts": info.experts, "top_k": info.top_k,
                           **{k: v.tolist() for k, v in views.items()},
                           "summary": {k: es.load_summary(v, info.top_k) for k, v in views.items()}})
        return {**head, "as_of": load.as_of, "serving_since": load.serving_since, "window_s": load.window_s,
                "window_span_s": load.window_span_s, "workers": load.workers, "layers": layers}


VIEWS = ("total", "window", "since_reset")
