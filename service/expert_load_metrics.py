"""The expert load in Prometheus, per MoE layer (never per expert: bounded cardinality), computed at
scrape time from the workers' merged snapshots (service/expert_load.py).

| family | type | what |
|---|---|---|
| ``moe_serve_expert_load_routed_total{layer}`` | counter | tokens x top-k routed to the layer's (logical) experts since serving began |
| ``moe_serve_expert_load_out_of_range_total{layer}`` | counter | routing ids of the layer that named none of its experts (EPLB: a slot with no logical expert), since serving began |
| ``moe_serve_expert_load_imbalance{layer}`` | gauge | busiest expert's load / mean load, over the window (absent without tokens) |
| ``moe_serve_expert_load_idle_experts{layer}`` | gauge | experts that got no token in the window |
| ``moe_serve_expert_load_experts{layer, le}`` | gauge histogram | experts by load / mean load, over the window: the spread (Grafana heatmap) |
| ``moe_serve_expert_load_window_seconds`` | gauge | the span the window covers now |

`layer` is the layer's number in the model. The full [layer x expert] matrix is at
GET /v1/moe/expert-load (service/expert_load_api.py).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from moe_serve.kernels.plugin.expert_snapshot import load_summary
from moe_serve.service.expert_load import ExpertLoadSource, columns

SHARE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)   # an expert's load / the layer's mean


def share_buckets(counts: np.ndarray) -> list[tuple[str, float]]:
    """Cumulative (le, experts) of one layer's [E] load over its mean, +Inf last; [] without tokens."""
    routed = int(counts.sum())
    if not routed:
        return []
    ratio = counts * counts.size / routed
    return [(f"{le:g}", float((ratio <= le).sum())) for le in SHARE_BUCKETS] + [("+Inf", float(counts.size))]


class ExpertLoadCollector:
    """Registered in the API registry: the families above, at scrape time."""

    def __init__(self, source: ExpertLoadSource) -> None:
        self.source = source

    def describe(self) -> list:
        return []  # known only at scrape time

    def collect(self) -> Iterator[Metric]:
        load = self.source.merged()
        if load is None:
            return
        routed = CounterMetricFamily("moe_serve_expert_load_routed", "Tokens routed to experts in each MoE "
                                     "layer since serving began, tokens x top-k (each token counts once per "
                                     "expert it goes to); counted on the device in the vLLM workers",
                                     labels=["layer"])
        imbalance = GaugeMetricFamily("moe_serve_expert_load_imbalance", "The busiest expert's load over the "
                                      "mean expert load of each MoE layer, over the sliding window (1 = uniform)",
                                      labels=["layer"])
        stray = CounterMetricFamily("moe_serve_expert_load_out_of_range", "Routing choices in each MoE layer "
                                    "since serving began whose expert id named none of the layer's experts (under "
                                    "EPLB: a physical slot with no logical expert); counted apart, not dropped",
                                    labels=["layer"])
        idle = GaugeMetricFamily("moe_serve_expert_load_idle_experts", "Experts of each MoE layer that got no "
                                 "token in the sliding window", labels=["layer"])
        spread = GaugeHistogramMetricFamily("moe_serve_expert_load_experts", "Experts of each MoE layer by "
                                            "their load over the layer's mean load (le), over the sliding window",
                                            labels=["layer"])
        for i, info in enumerate(load.layers):
            layer = str(info.layer)
            (total, out_of_range), (window, _) = columns(load.total[i], info), columns(load.window[i], info)
            summary = load_summary(window, info.top_k)
            routed.add_metric([layer], float(total.sum()))
            stray.add_metric([layer], float(out_of_range))
            idle.add_metric([layer], summary["idle_experts"])
            if summary["imbalance"] is not None:
                imbalance.add_metric([layer], summary["imbalance"])
                spread.add_metric([layer], share_buckets(window), float(info.experts))
        yield from (routed, stray, imbalance, idle, spread)
        yield GaugeMetricFamily("moe_serve_expert_load_window_seconds", "Seconds of serving the expert load "
                                "window covers now: its length (up to a snapshot interval more) once serving "
                                "is older than it",
                                value=load.window_span_s)
