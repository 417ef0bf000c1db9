"""moe_serve_requests_total counts every generation request, refused ones included; the Triton JIT
compile series exist (at 0) before anything compiles."""

from __future__ import annotations

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess
from tests.conftest import STRICT_METRICS_KEY
from tests.monitoring_helpers import delta, scrape, value

pytestmark = pytest.mark.engine
CMPL = "/v1/completions"
JSON = {"content-type": "application/json"}


def test_refused_requests_are_counted_with_their_outcome(server: ServerProcess, http: httpx.Client) -> None:
    before = scrape(server.base_url, server.headers)
    refusals = [
        (http.post(CMPL, content=b'{"model": ', headers=JSON), 400),  # malformed JSON
        (http.post(CMPL, content=b'{"prompt": "\\ud800"}', headers=JSON), 400),  # lone surrogate
        (http.post(CMPL, json={"prompt": "x", "stream": "yes"}), 400),  # strict boolean
        (http.post(CMPL, json={"prompt": "x", "max_tokens": "ten"}), 400),  # pydantic
        (http.post(CMPL, json={"prompt": "x", "logit_bias": {"5": 1000}}), 400),  # input limit
        (http.post(CMPL, json={"model": "gpt-17", "prompt": "x"}), 404),  # unknown model
        (httpx.post(server.base_url + CMPL, json={"prompt": "x"}), 401),  # no API key
        (http.post(CMPL, content=b"{" + b" " * (5 * 1024 * 1024) + b"}", headers=JSON), 413),
        (http.post("/v1/nope", json={}), 404),  # unknown route
    ]
    assert [r.status_code for r, _ in refusals] == [status for _, status in refusals]
    served = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
    assert served.status_code == 200
    after = scrape(server.base_url, server.headers)
    assert delta(before, after, "moe_serve_requests_total", status="client_error") == len(refusals)
    assert delta(before, after, "moe_serve_requests_total", status="ok") == 1
    assert delta(before, after, "moe_serve_requests_total") == len(refusals) + 1  # each counted once


def test_jit_compile_series_exist_at_zero_for_each_phase_before_any_compile(strict_server: ServerProcess) -> None:
    """The strict server loads no probe kernel: nothing compiles Triton on this CPU engine."""
    samples = scrape(strict_server.base_url, {"Authorization": f"Bearer {STRICT_METRICS_KEY}"})
    for phase in ("warmup", "serving"):
        phase_samples = [v for (name, labels), v in samples.items()
                         if name == "moe_serve_triton_jit_compiles_total" and ("phase", phase) in labels]
        assert phase_samples, f"no compile series for phase {phase}"
        assert value(samples, "moe_serve_triton_jit_compiles_total", phase=phase) == 0
