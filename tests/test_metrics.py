"""Metric values: unit checks of the building blocks, then exact deltas against the real server."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moe_serve.service.admission import Admission
from moe_serve.service.metrics import (FINISH_REASONS, STATUSES, DefaultRegistryBridge, ServiceMetrics, TokenRate,
                             status_for_http)
from tests.monitoring_helpers import delta, parse_metrics, scrape, value

MODEL = "m"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _samples(registry: CollectorRegistry) -> dict:
    return parse_metrics(generate_latest(registry).decode())


def test_token_rate_sliding_window() -> None:
    clock = FakeClock()
    rate = TokenRate(window_s=10.0, slots=20, clock=clock)
    assert rate.per_second() == 0.0
    clock.t += 2.0
    rate.add(100)
    assert rate.per_second() == pytest.approx(100 / 2.0)  # younger than the window: over uptime
    clock.t += 8.0
    rate.add(50)
    assert rate.per_second() == pytest.approx(150 / 10.0, rel=0.06)  # window edge: one slot
    clock.t += 5.0  # the 100 tokens (t=2) fell out of the window, the 50 (t=10) did not
    assert rate.per_second() == pytest.approx(50 / 10.0, rel=0.06)
    clock.t += 60.0  # long idle: stale slots are ignored, never re-counted
    assert rate.per_second() == 0.0
    rate.add(30)
    assert rate.per_second() == pytest.approx(30 / 10.0, rel=0.06)


def test_observer_counts_one_request_exactly() -> None:
    registry = CollectorRegistry()
    m = ServiceMetrics(registry, MODEL, reexport_default_registry=False)
    before = _samples(registry)
    obs = m.start(prompt_tokens=7)
    obs.admitted()
    assert value(_samples(registry), "moe_serve_requests_in_flight") == 1
    obs.on_tokens(0, 3)  # first chunk of sequence 0 with 3 tokens (outputs merged): 2 ITL observations
    obs.on_tokens(1, 1)  # first chunk of sequence 1: none
    obs.on_tokens(0, 2, "length")  # 2 more
    obs.on_tokens(1, 1, "stop")  # 1 more
    obs.finish("ok")
    obs.finish("server_error")  # idempotent
    after = _samples(registry)
    assert delta(before, after, "moe_serve_prompt_tokens_total") == 7
    assert delta(before, after, "moe_serve_generation_tokens_total") == 7
    assert delta(before, after, "moe_serve_inter_token_latency_seconds_count") == 7 - 2
    assert delta(before, after, "moe_serve_time_to_first_token_seconds_count") == 1
    assert delta(before, after, "moe_serve_e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "moe_serve_request_queue_time_seconds_count") == 1
    assert delta(before, after, "moe_serve_requests_total", status="ok") == 1
    assert delta(before, after, "moe_serve_requests_total") == 1
    assert delta(before, after, "moe_serve_finish_reasons_total", finish_reason="length") == 1
    assert delta(before, after, "moe_serve_finish_reasons_total", finish_reason="stop") == 1
    assert value(after, "moe_serve_requests_in_flight") == 0
    assert value(after, "moe_serve_output_tokens_per_second") > 0


def test_rejected_request_is_counted_but_not_in_flight() -> None:
    registry = CollectorRegistry()
    m = ServiceMetrics(registry, MODEL, reexport_default_registry=False)
    obs = m.start(prompt_tokens=5)
    obs.finish(status_for_http(429))
    after = _samples(registry)
    assert value(after, "moe_serve_requests_total", status="rejected") == 1
    assert value(after, "moe_serve_prompt_tokens_total") == 0  # never reached the engine
    assert value(after, "moe_serve_requests_in_flight") == 0
    assert value(after, "moe_serve_request_queue_time_seconds_count") == 0


def test_every_status_and_finish_reason_exported_from_start() -> None:
    registry = CollectorRegistry()
    ServiceMetrics(registry, MODEL, reexport_default_registry=False)
    samples = _samples(registry)
    for status in STATUSES:
        assert ("moe_serve_requests_total", frozenset({("model", MODEL), ("status", status)})) in samples
    for reason in FINISH_REASONS:
        assert ("moe_serve_finish_reasons_total",
                frozenset({("model", MODEL), ("finish_reason", reason)})) in samples


def test_waiting_gauge_reads_the_admission_queue() -> None:
    async def scenario() -> tuple[float, float]:
        admission = Admission(max_running=1, max_queued=10, max_prompt_tokens=None)
        registry = CollectorRegistry()
        ServiceMetrics(registry, MODEL, queued=lambda: admission.queued, reexport_default_registry=False)
        first = await admission.acquire(1)
        waiters = [asyncio.create_task(admission.acquire(1)) for _ in range(2)]
        await asyncio.sleep(0)
        queued = value(_samples(registry), "moe_serve_requests_waiting")
        first.release()
        (await waiters[0]).release()
        (await waiters[1]).release()
        return queued, value(_samples(registry), "moe_serve_requests_waiting")

    assert asyncio.run(scenario()) == (2, 0)


def test_bridge_reexports_default_registry_without_duplicates() -> None:
    source = CollectorRegistry()
    Gauge("vllm:num_requests_running", "engine running", registry=source).set(3)
    Counter("moe_serve_generation_tokens", "would be a duplicate", registry=source).inc(5)
    ours = CollectorRegistry()
    m = ServiceMetrics(ours, MODEL, reexport_default_registry=False)
    ours.register(DefaultRegistryBridge(source))
    m.start(1).finish("ok")
    samples = _samples(ours)  # parse_metrics raises on a duplicate sample
    assert value(samples, "vllm:num_requests_running") == 3
    assert value(samples, "moe_serve_generation_tokens_total") == 0  # ours, not the source's 5


def test_bridge_offsets_counts_from_the_end_of_the_warm_up() -> None:
    """After offset_now(), counters and histograms count from then on; gauges stay as they are."""
    source = CollectorRegistry()
    done = Counter("vllm:request_success", "finished", ["finished_reason"], registry=source)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e2e", registry=source, buckets=(1.0,))
    running = Gauge("vllm:num_requests_running", "running", registry=source)
    bridge = DefaultRegistryBridge(source)
    ours = CollectorRegistry()
    ours.register(bridge)
    done.labels("stop").inc(16)
    e2e.observe(0.5)
    running.set(2)
    bridge.offset_now()
    done.labels("stop").inc(3)
    done.labels("length").inc()
    e2e.observe(2.0)
    samples = _samples(ours)
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 3
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(samples, "vllm:e2e_request_latency_seconds_bucket", le="1.0") == 0
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert value(samples, "vllm:num_requests_running") == 2


# --- against the real server (shared session fixture; other tests use it too: deltas only) ---

def _completion(http: httpx.Client, model: str, **body) -> tuple[dict, float]:
    began = time.perf_counter()
    resp = http.post("/v1/completions", json={"model": model, **body})
    assert resp.status_code == 200, resp.text
    return resp.json(), time.perf_counter() - began


def _stream_chat(http: httpx.Client, model: str, **body) -> tuple[dict, float]:
    """Streamed chat with include_usage; returns {'usage', 'finish_reasons'} and the wall time."""
    import json

    began = time.perf_counter()
    usage, reasons = None, []
    with http.stream("POST", "/v1/chat/completions", json={
            "model": model, "stream": True, "stream_options": {"include_usage": True}, **body}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            reasons += [c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")]
    return {"usage": usage, "choices": [{"finish_reason": r} for r in reasons]}, time.perf_counter() - began


def test_server_metrics_match_usage(server, http: httpx.Client, model: str) -> None:
    before = scrape(server.base_url, server.headers)
    results = [
        _completion(http, model, prompt="Hello there", max_tokens=9, ignore_eos=True),
        _completion(http, model, prompt="Once upon a time", max_tokens=6, n=2, ignore_eos=True),
        _completion(http, model, prompt=["one prompt", "and another one"], max_tokens=5),
        _completion(http, model, prompt="stop early", max_tokens=12, temperature=0),
        _stream_chat(http, model, messages=[{"role": "user", "content": "Hi"}], max_tokens=7, n=2),
    ]
    after = scrape(server.base_url, server.headers)
    prompt = sum(r["usage"]["prompt_tokens"] for r, _ in results)
    generated = sum(r["usage"]["completion_tokens"] for r, _ in results)
    sequences = sum(len(r["choices"]) for r, _ in results)
    reasons = [c["finish_reason"] for r, _ in results for c in r["choices"]]
    n = len(results)
    assert generated >= sequences  # every choice produced at least one token
    assert delta(before, after, "moe_serve_requests_total", status="ok") == n
    assert delta(before, after, "moe_serve_requests_total") == n
    assert delta(before, after, "moe_serve_prompt_tokens_total") == prompt
    assert delta(before, after, "moe_serve_generation_tokens_total") == generated
    assert delta(before, after, "moe_serve_time_to_first_token_seconds_count") == n
    assert delta(before, after, "moe_serve_e2e_request_latency_seconds_count") == n
    assert delta(before, after, "moe_serve_request_queue_time_seconds_count") == n
    assert delta(before, after, "moe_serve_inter_token_latency_seconds_count") == generated - sequences
    for reason in set(reasons):
        assert delta(before, after, "moe_serve_finish_reasons_total", finish_reason=reason) == reasons.count(reason)
    assert delta(before, after, "moe_serve_finish_reasons_total") == sequences
    # Server-side times are inside the client-side wall times.
    wall = sum(t for _, t in results)
    assert 0 < delta(before, after, "moe_serve_time_to_first_token_seconds_sum") <= wall
    e2e = delta(before, after, "moe_serve_e2e_request_latency_seconds_sum")
    assert delta(before, after, "moe_serve_time_to_first_token_seconds_sum") < e2e <= wall
    assert value(after, "moe_serve_requests_in_flight", model=model) == 0
    assert value(after, "moe_serve_requests_waiting", model=model) == 0
    assert value(after, "moe_serve_output_tokens_per_second", model=model) > 0


def test_server_reexports_vllm_metrics(server, http: httpx.Client, model: str) -> None:
    before = scrape(server.base_url, server.headers)
    body, _ = _completion(http, model, prompt="count me", max_tokens=8, ignore_eos=True)
    generated = body["usage"]["completion_tokens"]
    deadline = time.monotonic() + 10  # vLLM records its stats from the output handler, just after
    while True:
        after = scrape(server.base_url, server.headers)
        got = delta(before, after, "vllm:generation_tokens_total", model_name=model)
        if got >= generated or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == generated
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert any(n == name for n, _ in after), f"{name} not re-exported"
    assert any(n == "process_resident_memory_bytes" for n, _ in after)


def test_unknown_model_is_not_counted_as_served(server, http: httpx.Client, model: str) -> None:
    before = scrape(server.base_url, server.headers)
    resp = http.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 404
    after = scrape(server.base_url, server.headers)
    assert delta(before, after, "moe_serve_requests_total", status="ok") == 0
    assert delta(before, after, "moe_serve_generation_tokens_total") == 0
