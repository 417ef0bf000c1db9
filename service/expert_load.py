"""The workers' expert load in the API process: their snapshots merged, and the views of it.

Sources: this node's snapshot files in the runtime dir and the last reports of workers on other
nodes (kernels/plugin/expert_snapshot.py; service/worker_metrics.RemoteWorkers), read when asked
(a scrape, the JSON endpoint). Merge: tensor-parallel ranks route the same tokens with the same
replicated gate, so each holds the same counts; pipeline stages hold different layers. Per layer,
the merged counts are the element-wise max over the workers that count it: any one TP rank's, each
stage's own layers. (moe-serve runs one engine: no data-parallel ranks whose tokens would add.)

Experts are logical ones (under vLLM's EPLB the workers map physical slots to them); each layer
also has its routing ids that named none of its experts, counted apart (``out_of_range``).

Three views of each layer's tokens per expert [E]:
- ``total``: since serving began (warm-up excluded: kernels/plugin/expert_load.py); the Prometheus
  counter's source, never reset.
- ``window``: the last ``window_s`` seconds (each worker's newest snapshot minus its snapshot at or
  just before the window's start; snapshots every second, so it spans up to a second more:
  ``window_span_s``). Imbalance, idle experts and the load spread in Prometheus
  are the window's.
- ``since_reset``: since the last ``POST /v1/moe/expert-load/reset`` (`reset`), or ``total`` if none
  since serving began. The reset's baseline is every worker's counts at the reset, asked for over
  vLLM's collective_rpc (es.SNAPSHOT_RPC): a request that finished before the reset is answered
  is never in it. A reset changes nothing else.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moe_serve.kernels.plugin import expert_snapshot as es
from moe_serve.service.errors import APIError
from moe_serve.service.worker_metrics import RemoteWorkers

RESET_TIMEOUT_S = 30.0   # the workers' answer to a reset (they answer between two engine steps)


@dataclass
class MergedLoad:
    """Every worker's snapshot as one: layers by their number in the model."""

    layers: list[es.LayerInfo]
    total: np.ndarray               # [L, E_max + 1] int64: a layer's experts, then its out-of-range count
    window: np.ndarray              # [L, E_max + 1] int64
    as_of: float                    # unix time of the oldest snapshot merged
    serving_since: float            # unix time serving (re)started, the latest over workers
    window_s: float                 # the window's configured length
    window_span_s: float            # what it covers now (shorter while serving is younger)
    workers: int


def merge(snapshots: list[dict[str, Any]]) -> MergedLoad | None:
    """The snapshots of all workers (expert_snapshot.read_snapshot's form) merged; None if none.
    Row i holds layer i's E experts, then its out-of-range count in column E (`columns`)."""
    if not snapshots:
        return None
    rows: dict[str, tuple[es.LayerInfo, np.ndarray, np.ndarray]] = {}
    for snap in snapshots:
        for i, layer in enumerate(snap["meta"]["layers"]):
            info = es.LayerInfo(**layer)
            total, window = snap["total"][i, :info.experts + 1], snap["window"][i, :info.experts + 1]
            if info.name in rows:
                _, t, w = rows[info.name]
                total, window = np.maximum(t, total), np.maximum(w, window)
            rows[info.name] = (info, total, window)
    ordered = sorted(rows.values(), key=lambda r: (r[0].layer, r[0].name))
    width = max(info.experts for info, _, _ in ordered) + 1
    pad = lambda a: np.pad(a, (0, width - a.size))  # noqa: E731 - rows of layers with fewer experts
    metas = [s["meta"] for s in snapshots]
    return MergedLoad(layers=[r[0] for r in ordered], total=np.stack([pad(r[1]) for r in ordered]),
                      window=np.stack([pad(r[2]) for r in ordered]), as_of=min(m["time"] for m in metas),
                      serving_since=max(m["serving_since"] for m in metas), window_s=metas[0]["window_s"],
                      window_span_s=min(m["window_span_s"] for m in metas), workers=len(snapshots))


def columns(row: np.ndarray, info: es.LayerInfo) -> tuple[np.ndarray, int]:
    """A merged row of layer `info`: (its experts' counts [E], its out-of-range count)."""
    return row[:info.experts], int(row[info.experts])


@dataclass
class ExpertLoadSource:
    """Reads and merges the workers' snapshots; holds the JSON view's reset point."""

    runtime_dir: Path
    remote: RemoteWorkers | None = None
    reset_at: float | None = None
    _baseline: dict[str, np.ndarray] = field(default_factory=dict)   # layer name -> total [E + 1] at reset

    def merged(self) -> MergedLoad | None:
        snaps = es.read_snapshots(str(self.runtime_dir))
        if self.remote is not None:
            snaps += [es.from_report(r["expert_load"]) for r in self.remote.reports if r.get("expert_load")]
        return merge(snaps)

    async def reset(self, engine: Any) -> None:
        """Counting for `since_reset` begins now: every worker's counts at this moment (vLLM's
        AsyncLLM `engine`'s collective_rpc) are the baseline. 503 while the engine cannot answer."""
        if engine is None:
            raise APIError(503, "the engine is not serving; retry", code="engine_unavailable",
                           headers={"Retry-After": "5"})
        try:
            answers = await asyncio.wait_for(engine.collective_rpc(es.SNAPSHOT_RPC, timeout=RESET_TIMEOUT_S),
                                             RESET_TIMEOUT_S + 1)
        except Exception as exc:  # noqa: BLE001 - the reset did not happen; the client may retry
            raise APIError(503, f"the workers did not report their expert load ({type(exc).__name__}); retry",
                           code="engine_unavailable", headers={"Retry-After": "1"}) from exc
        load = merge([es.from_report(a) for a in answers if a])
        self.reset_at = time.time()
        self._baseline = {} if load is None else \
            {info.name: load.total[i, :info.experts + 1].copy() for i, info in enumerate(load.layers)}

    def since_reset(self, load: MergedLoad, row: int) -> np.ndarray:
        """Layer `row`'s counts since the reset ([E + 1]: its experts, then its out-of-range count)."""
        info = load.layers[row]
        total = load.total[row, :info.experts + 1]
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
            views = {"total": load.total[i], "window": load.window[i], "since_reset": self.since_reset(load, i)}
            split = {k: columns(v, info) for k, v in views.items()}
            layers.append({"layer": info.layer, "name": info.name, "experts": info.experts, "top_k": info.top_k,
                           **{k: experts.tolist() for k, (experts, _) in split.items()},
                           "out_of_range": {k: stray for k, (_, stray) in split.items()},
                           "summary": {k: es.load_summary(experts, info.top_k) for k, (experts, _) in split.items()}})
        return {**head, "as_of": load.as_of, "serving_since": load.serving_since, "window_s": load.window_s,
                "window_span_s": load.window_span_s, "workers": load.workers, "layers": layers}


VIEWS = ("total", "window", "since_reset")
