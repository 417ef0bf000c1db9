"""The expert load (kernels/plugin/expert_load.py, service/expert_load*.py) on the real CPU engine.

vLLM's CPU engine routes with vLLM's own router, traced by torch.compile with our count in its
graph: known requests (random token ids, so no prefix-cache hit and no text dependence) must add
exactly tokens x top-k per layer, (prompt + output - 1) tokens each, every token to top-k distinct
experts. The JSON endpoint, its reset, the Prometheus families and --no-expert-stats (the strict
server) are checked on the same servers.
"""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moe_serve.kernels.plugin.expert_snapshot import INTERVAL_S
from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess
from tests.conftest import STRICT_METRICS_KEY
from tests.monitoring_helpers import EXPERT_LOAD_PATH as PATH
from tests.monitoring_helpers import fresh_expert_load, scrape, value

pytestmark = pytest.mark.engine
LAYERS, EXPERTS, TOP_K = [0, 1], 8, 2            # the embedded tiny Mixtral


def _idle(server: ServerProcess) -> None:
    """Wait until the engine runs nothing (an earlier test's aborted work is gone)."""
    deadline = time.monotonic() + 60
    while httpx.get(server.base_url + "/health", timeout=10).json().get("unfinished_requests"):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.2)


def _fresh(server: ServerProcess, method: str = "GET", path: str = PATH) -> dict:
    return fresh_expert_load(server.base_url, server.headers, method, path)


def _known_requests(server: ServerProcess) -> int:
    """Six concurrent completions of random token-id prompts; the tokens their forwards ran:
    per choice, prompt + output - 1 (the last token is sampled, never fed back)."""
    def one(i: int) -> int:
        prompt = [random.randrange(1000, 31000) for _ in range(9 + 7 * i)]
        r = httpx.post(server.base_url + "/v1/completions", headers=server.headers, timeout=120,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3 + i, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 3 + i
        return usage["prompt_tokens"] + usage["completion_tokens"] - 1

    with ThreadPoolExecutor(3) as pool:
        return sum(pool.map(one, range(6)))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _per_layer(body: dict, view: str) -> list[list[int]]:
    return [layer[view] for layer in body["layers"]]


def test_counts_are_tokens_times_top_k_per_layer(server: ServerProcess) -> None:
    _idle(server)
    before = _fresh(server)
    assert [(x["layer"], x["experts"], x["top_k"]) for x in before["layers"]] == \
        [(n, EXPERTS, TOP_K) for n in LAYERS]
    assert before["workers"] == 1 and before["layers"][0]["name"] == "model.layers.0.block_sparse_moe.experts"
    tokens = _known_requests(server)
    after = _fresh(server)
    for b, a in zip(_per_layer(before, "total"), _per_layer(after, "total")):
        delta = [y - x for x, y in zip(b, a)]
        assert sum(delta) == tokens * TOP_K, (delta, tokens)
        assert all(0 <= d <= tokens for d in delta), delta     # each token: top-k distinct experts
    for layer in after["layers"]:
        assert layer["summary"]["total"]["routed"] == sum(layer["total"])
        assert sum(layer["window"]) >= tokens * TOP_K        # the last minute holds these requests
        assert layer["summary"]["window"]["idle_experts"] == layer["window"].count(0)


def test_reset_starts_since_reset_and_prometheus_agrees(server: ServerProcess) -> None:
    _idle(server)
    reset = _fresh(server, "POST", PATH + "/reset")
    assert reset["reset_at"] is not None and all(not any(c) for c in _per_layer(reset, "since_reset"))
    tokens = _known_requests(server)
    body = _fresh(server)
    assert [sum(c) for c in _per_layer(body, "since_reset")] == [tokens * TOP_K] * len(LAYERS)
    assert [[t - r for t, r in zip(a, b)] for a, b in zip(_per_layer(body, "total"), _per_layer(reset, "total"))] \
        == _per_layer(body, "since_reset")
    metrics = scrape(server.base_url, server.headers)     # the same snapshots: the engine is idle
    for layer in body["layers"]:
        n = str(layer["layer"])
        window = layer["summary"]["window"]
        assert value(metrics, "moe_serve_expert_load_routed_total", layer=n) == sum(layer["total"])
        assert value(metrics, "moe_serve_expert_load_imbalance", layer=n) == pytest.approx(window["imbalance"])
        assert value(metrics, "moe_serve_expert_load_idle_experts", layer=n) == window["idle_experts"]
        mean = sum(layer["window"]) / EXPERTS
        for le in ("0.5", "1", "2"):
            want = sum(c <= float(le) * mean for c in layer["window"])
            assert value(metrics, "moe_serve_expert_load_experts_bucket", layer=n, le=le) == want
        assert value(metrics, "moe_serve_expert_load_experts_bucket", layer=n, le="+Inf") == EXPERTS
    span = value(metrics, "moe_serve_expert_load_window_seconds")      # from a snapshot at or before its start
    assert span == body["window_span_s"] and 0 < span <= body["window_s"] + 2 * INTERVAL_S and body["window_s"] == 60


def _routed(body: dict, view: str) -> list[int]:
    return [sum(layer[view]) for layer in body["layers"]]


def test_a_request_finished_just_before_a_reset_is_not_in_since_reset(server: ServerProcess) -> None:
    """The reset asks the workers for their counts at that moment: its answer already holds the
    request that finished just before it in `total`, and none of it in `since_reset`; repeated."""
    _idle(server)
    previous = httpx.post(server.base_url + PATH + "/reset", headers=server.headers, timeout=60).json()
    for _ in range(5):
        prompt = [random.randrange(1000, 31000) for _ in range(5)]
        r = httpx.post(server.base_url + "/v1/completions", headers=server.headers, timeout=120,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        tokens = r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] - 1
        reset = httpx.post(server.base_url + PATH + "/reset", headers=server.headers, timeout=60)
        assert reset.status_code == 200, reset.text
        body = reset.json()
        added = [a - b for a, b in zip(_routed(body, "total"), _routed(previous, "total"))]
        assert added == [tokens * TOP_K] * len(LAYERS), (added, tokens)
        assert _routed(body, "since_reset") == [0, 0] and body["reset_at"] > previous["reset_at"]
        assert all(layer["out_of_range"] == {"total": 0, "window": 0, "since_reset": 0} for layer in body["layers"])
        previous = body


def test_the_endpoint_needs_the_api_key(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + PATH, timeout=30).status_code == 401
    assert httpx.post(server.base_url + PATH + "/reset", timeout=30).status_code == 401


def test_off_switch_counts_nothing_and_exports_nothing(server: ServerProcess, strict_server: ServerProcess,
                                                      embedded_model_dir: str) -> None:
    """The strict server runs with --no-expert-stats: no route, no family, no counting in the
    workers (which the session server's worker logs it does)."""
    model = Path(embedded_model_dir).name                     # the strict server's served name
    r = httpx.post(strict_server.base_url + "/v1/completions", headers=strict_server.headers, timeout=120,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert httpx.get(strict_server.base_url + PATH, headers=strict_server.headers, timeout=30).status_code == 404
    text = httpx.get(strict_server.base_url + "/metrics", timeout=30, headers=_bearer(STRICT_METRICS_KEY)).text
    assert "moe_serve_requests_total" in text and "moe_serve_expert_load" not in text
    counting = f"moe-serve expert load: counting {len(LAYERS)} MoE layers ({EXPERTS} experts, top-{TOP_K})"
    assert counting in server.log() and "expert load" not in strict_server.log()
