"""Prometheus metrics observed at the HTTP routes (TTFT, ITL, e2e, tokens, requests).

Names are part of the product (dashboards and alerts depend on them): keep them stable.
Histogram buckets resolve both the CPU-tiny range (ms) and H200 serving (10 ms..minutes).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "moe_serve"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.2, 0.5, 1.0, 2.5)


class ServiceMetrics:
    """All route-level metrics, registered in one registry."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.registry = registry
        self.model = model
        labels = ["model"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from request arrival to the first "
                              "generated token.", labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive generated tokens "
                             "of one sequence.", labels, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from request arrival to its last "
                             "token.", labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", labels,
                                         registry=registry)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by status.", ["model", "status"],
                                registry=registry)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests being served now.", labels,
                               registry=registry)

    def start(self) -> "RequestObserver":
        return RequestObserver(self)


class RequestObserver:
    """Times one request; call `on_tokens` per engine output, then `finish` once."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.m = metrics
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self._last_token_at: dict[int, float] = {}  # per sequence index
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._finished = False
        metrics.in_flight.labels(metrics.model).inc()

    def on_tokens(self, sequence: int, new_tokens: int) -> None:
        """Record `new_tokens` of sequence `sequence` that arrived now."""
        if new_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.m.ttft.labels(self.m.model).observe(now - self.arrival)
        last = self._last_token_at.get(sequence)
        if last is not None:
            gap = (now - last) / new_tokens
            hist = self.m.itl.labels(self.m.model)
            for _ in range(new_tokens):
                hist.observe(gap)
        self._last_token_at[sequence] = now
        self.generation_tokens += new_tokens

    def finish(self, status: str) -> None:
        """status: 'ok', 'client_error', 'server_error', 'aborted', 'rejected'."""
        if self._finished:
            return
        self._finished = True
        m, model = self.m, self.m.model
        m.in_flight.labels(model).dec()
        m.requests.labels(model, status).inc()
        if status == "ok":
            m.e2e.labels(model).observe(time.perf_counter() - self.arrival)
        m.prompt_tokens.labels(model).inc(self.prompt_tokens)
        m.generation_tokens.labels(model).inc(self.generation_tokens)
