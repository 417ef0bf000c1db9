"""Prometheus metrics observed at the HTTP routes (TTFT, ITL, e2e, queue time, tokens, requests).

Names are part of the product (dashboards and alerts in monitoring/ depend on them): keep them
stable. Histogram buckets resolve both the CPU-tiny range (sub-ms) and H200 serving
(10 ms..minutes). Everything is labelled by `model`. vLLM's own `vllm:*` series (registered
by `AsyncLLM` in prometheus_client's default registry) are re-exported through
`DefaultRegistryBridge`, so one `/metrics` text carries both without double registration.

Cost per output chunk: one histogram observation per token (ITL), a dict update and a ring
buffer add; no per-token allocation. Scrape-time values (waiting, tokens/s) are computed by
`ScrapeTimeCollector` only when Prometheus scrapes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

PREFIX = "moe_serve"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.2, 0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Request outcomes (label `status`); every value is exported from start-up with 0.
STATUSES = ("ok", "client_error", "server_error", "aborted", "rejected")
# vLLM finish reasons of one generated sequence (label `finish_reason`), pre-initialised too.
FINISH_REASONS = ("stop", "length", "abort")
TOKEN_RATE_WINDOW_S = 10.0
COUNTED = "moe_serve.counted"  # ASGI scope key: a route's RequestObserver counts this request
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away first


def status_for_http(status_code: int | None) -> str:
    """The `status` label of a request answered with `status_code` (None: nothing was sent)."""
    if status_code is None or status_code == CLIENT_CLOSED:
        return "aborted"
    if status_code == 429:
        return "rejected"
    if status_code < 400:
        return "ok"
    return "client_error" if status_code < 500 else "server_error"


class TokenRate:
    """Tokens per second over a sliding window: a fixed ring of time slots, no allocation per add."""

    def __init__(self, window_s: float = TOKEN_RATE_WINDOW_S, slots: int = 40,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.slot_s = window_s / slots
        self.window_s = window_s
        self.clock = clock
        self._counts = [0] * slots
        self._epochs = [-1] * slots  # which slot number each entry currently holds
        self._start = clock()

    def add(self, tokens: int, now: float | None = None) -> None:
        epoch = int(((self.clock() if now is None else now) - self._start) / self.slot_s)
        i = epoch % len(self._counts)
        if self._epochs[i] != epoch:
            self._epochs[i] = epoch
            self._counts[i] = 0
        self._counts[i] += tokens

    def per_second(self, now: float | None = None) -> float:
        """Tokens added in the last `window_s` (the current partial slot included) / elapsed time."""
        elapsed = (self.clock() if now is None else now) - self._start
        current = int(elapsed / self.slot_s)
        oldest = current - len(self._counts) + 1
        total = sum(c for c, e in zip(self._counts, self._epochs) if oldest <= e <= current)
        span = elapsed - max(oldest, 0) * self.slot_s
        return total / span if span > 0 else 0.0


class ScrapeTimeCollector:
    """Gauges computed when scraped: admission queue length and output tokens/s."""

    def __init__(self, model: str, rate: TokenRate, queued: Callable[[], int] | None) -> None:
        self.model = model
        self.rate = rate
        self.queued = queued

    def describe(self) -> list[Metric]:
        return []  # names are not claimed: nothing else in our registry uses them

    def collect(self) -> Iterator[Metric]:
        tps = GaugeMetricFamily(f"{PREFIX}_output_tokens_per_second", "Generated tokens per second over the "
                                f"last {TOKEN_RATE_WINDOW_S:g} s (all requests).", labels=["model"])
        tps.add_metric([self.model], self.rate.per_second())
        yield tps
        waiting = GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Requests waiting in the server's "
                                    "admission queue (not yet sent to the engine).", labels=["model"])
        waiting.add_metric([self.model], float(self.queued() if self.queued else 0))
        yield waiting


COUNTED_TYPES = ("counter", "histogram", "summary")  # metric types whose samples only grow


class DefaultRegistryBridge:
    """Re-exports what vLLM (and prometheus_client's process/GC collectors) put in the default registry.

    `AsyncLLM` registers its `vllm:*` metrics in `prometheus_client.REGISTRY` (or, when
    PROMETHEUS_MULTIPROC_DIR is set, writes them for a `MultiProcessCollector`). Registering
    this bridge in our own registry serves them in the same `/metrics` text; families named
    `moe_serve_*` are skipped so nothing is exported twice. `offset_now()` (called once the
    start-up warm-up is done) makes every counter, histogram and summary sample count from then on,
    so vLLM's series, like ours, leave the warm-up requests out.
    """

    def __init__(self, source: CollectorRegistry | None = None, skip_prefix: str = PREFIX) -> None:
        self._source = source
        self.skip_prefix = skip_prefix
        self._offsets: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def _registry(self) -> CollectorRegistry:
        if self._source is not None:
            return self._source
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            self._source = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._source)
            return self._source
        return REGISTRY

    def describe(self) -> list[Metric]:
        return []

    def _families(self) -> Iterator[Metric]:
        seen: set[str] = set()
        for family in self._registry().collect():
            if family.name.startswith(self.skip_prefix) or family.name in seen:
                continue
            seen.add(family.name)
            yield family

    @staticmethod
    def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
        return sample.name, tuple(sorted(sample.labels.items()))

    def offset_now(self) -> None:
        """From now on, export counts minus what they are now (not gauges, not *_created times)."""
        self._offsets = {self._key(s): s.value for family in self._families() if family.type in COUNTED_TYPES
                         for s in family.samples if not s.name.endswith("_created")}

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            if self._offsets and family.type in COUNTED_TYPES:
                family.samples = [s if s.name.endswith("_created") else
                                  s._replace(value=s.value - self._offsets.get(self._key(s), 0.0))
                                  for s in family.samples]
            yield family


class ServiceMetrics:
    """All route-level metrics, registered in one registry."""

    def __init__(self, registry: CollectorRegistry, model: str, queued: Callable[[], int] | None = None,
                 reexport_default_registry: bool = True) -> None:
        self.registry = registry
        self.model = model
        labels = ["model"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from request arrival to the first "
                              "generated token (queue time included).", labels, buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive generated tokens "
                             "of one sequence (one observation per token after a sequence's first).", labels,
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from request arrival to its last "
                             "token (successful requests).", labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram(f"{PREFIX}_request_queue_time_seconds", "Time a request waited in the server's "
                               "admission queue before going to the engine.", labels, buckets=QUEUE_BUCKETS,
                               registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", labels,
                                         registry=registry)
        self.requests = Counter(f"{PREFIX}_requests", "Requests to the generation routes (POST /v1/...), "
                                "refused ones included, by outcome (ok, client_error = 4xx, server_error = 5xx, "
                                "aborted = client gone, rejected = 429).", ["model", "status"], registry=registry)
        self.finish_reasons = Counter(f"{PREFIX}_finish_reasons", "Generated sequences (choices) by vLLM "
                                      "finish reason.", ["model", "finish_reason"], registry=registry)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Admitted requests being served now.", labels,
                               registry=registry)
        self.rate = TokenRate()
        registry.register(ScrapeTimeCollector(model, self.rate, queued))
        self.vllm_series: DefaultRegistryBridge | None = None
        if reexport_default_registry:
            self.vllm_series = DefaultRegistryBridge()
            registry.register(self.vllm_series)
        self._init_children()
        self.model_ttft, self.model_itl = self.ttft.labels(model), self.itl.labels(model)  # per token: no lookup

    def _init_children(self) -> None:
        """Export every series from start-up (0), so rates and ratios exist before the first event."""
        for h in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                  self.in_flight):
            h.labels(self.model)
        for status in STATUSES:
            self.requests.labels(self.model, status)
        for reason in FINISH_REASONS:
            self.finish_reasons.labels(self.model, reason)

    def start(self, prompt_tokens: int = 0) -> "RequestObserver":
        """A request arrived (before admission)."""
        return RequestObserver(self, prompt_tokens)

    def refused(self, http_status: int | None) -> None:
        """A generation request that ended before a RequestObserver saw it (auth, body, validation)."""
        self.requests.labels(self.model, status_for_http(http_status)).inc()


class RequestObserver:
    """Times one request: `admitted()`, then `on_tokens` per engine output, then `finish` once."""

    def __init__(self, metrics: ServiceMetrics, prompt_tokens: int = 0) -> None:
        self.m = metrics
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self._last_token_at: dict[Hashable, float] = {}  # per sequence (engine request, choice)
        self._finish_reasons: list[str] = []
        self.prompt_tokens = prompt_tokens
        self.generation_tokens = 0
        self.admitted_at: float | None = None
        self._finished = False

    def admitted(self) -> None:
        """The request left the admission queue and goes to the engine."""
        if self.admitted_at is None:
            self.admitted_at = time.perf_counter()
            self.m.queue.labels(self.m.model).observe(self.admitted_at - self.arrival)
            self.m.in_flight.labels(self.m.model).inc()

    def on_tokens(self, sequence: Hashable, new_tokens: int, finish_reason: str | None = None) -> None:
        """Record `new_tokens` of sequence `sequence` that arrived now (and its finish reason, if last)."""
        if finish_reason is not None:
            self._finish_reasons.append(finish_reason)
        if new_tokens <= 0:
            return
        now = time.perf_counter()
        m = self.m
        if self.first_token_at is None:
            self.first_token_at = now
            m.model_ttft.observe(now - self.arrival)
        last = self._last_token_at.get(sequence)
        hist = m.model_itl
        if last is None:  # a sequence's first chunk: tokens beyond its first arrived together (gap 0)
            for _ in range(new_tokens - 1):
                hist.observe(0.0)
        else:
            gap = (now - last) / new_tokens
            for _ in range(new_tokens):
                hist.observe(gap)
        self._last_token_at[sequence] = now
        self.generation_tokens += new_tokens
        m.rate.add(new_tokens, now)

    def finish(self, status: str) -> None:
        """status: one of STATUSES. Idempotent."""
        if self._finished:
            return
        self._finished = True
        m, model = self.m, self.m.model
        m.requests.labels(model, status).inc()
        for reason in self._finish_reasons:
            m.finish_reasons.labels(model, reason).inc()
        if self.admitted_at is None:
            return
        m.in_flight.labels(model).dec()
        if status == "ok":
            m.e2e.labels(model).observe(time.perf_counter() - self.arrival)
        m.prompt_tokens.labels(model).inc(self.prompt_tokens)
        m.generation_tokens.labels(model).inc(self.generation_tokens)

