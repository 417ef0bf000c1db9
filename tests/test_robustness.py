"""Robustness against a real server with tight limits: schema fuzzing, overload, memory."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis

from loadtest.server_proc import MODEL_NAME, ServerProcess, start_server

pytestmark = pytest.mark.engine
LIMITS = ["--max-concurrent-requests", "2", "--max-queued-requests", "2", "--max-tokens-limit", "32",
          "--max-n", "4"]
# Cases over all operations; the manual target raises it: MOE_SERVE_FUZZ_EXAMPLES=2000 pytest -k fuzzed
FUZZ_EXAMPLES = int(os.environ.get("MOE_SERVE_FUZZ_EXAMPLES", "200"))


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(Path(tmp_path_factory.mktemp("limited")), *LIMITS)
    yield srv
    srv.stop()


def _fuzz_strategy():
    """Cases for every operation of the server's own OpenAPI schema (valid and invalid bodies)."""
    from hypothesis import strategies as st

    from service.app import create_app
    from service.settings import Settings

    schema = schemathesis.openapi.from_dict(create_app(Settings(), "/unused").openapi())
    return st.one_of([result.ok().as_strategy() for result in schema.get_all_operations()])


def _unknown_fields():
    """Fields no request model has (mixed into about half of the JSON bodies): each must be a 400."""
    from hypothesis import strategies as st

    names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12).map(lambda s: "x_" + s)
    return st.one_of(st.none(), st.dictionaries(names, st.one_of(st.integers(), st.text(max_size=5), st.none()),
                                                min_size=1, max_size=2))


@hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(case=_fuzz_strategy(), unknown=_unknown_fields())
def test_fuzzed_requests_never_5xx_and_every_4xx_is_an_openai_error(case, unknown,
                                                                    limited_server: ServerProcess) -> None:
    if unknown and isinstance(case.body, dict):
        case.body = {**case.body, **unknown}
    response = case.call(base_url=limited_server.base_url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    elif unknown and isinstance(case.body, dict) and case.method == "POST":
        raise AssertionError(f"unknown fields {sorted(unknown)} were accepted: {case.path} {case.body}")


def test_server_still_serves_after_fuzzing(limited_server: ServerProcess) -> None:
    resp = httpx.post(limited_server.base_url + "/v1/completions",
                      json={"model": MODEL_NAME, "prompt": "ok?", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 200, resp.text


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _flood(server: ServerProcess, clients: int) -> list[tuple[int, list[str], dict]]:
    results: list[tuple[int, list[str], dict]] = []
    lock = threading.Lock()
    body = {"model": MODEL_NAME, "prompt": "flood", "max_tokens": 32, "ignore_eos": True, "stream": True}

    def one() -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            with lock:
                results.append((resp.status_code, events, dict(resp.headers)))

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


def test_overload_gets_429_with_retry_after_and_admitted_streams_complete(limited_server: ServerProcess) -> None:
    results = _flood(limited_server, 16)
    assert len(results) == 16
    admitted = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert len(admitted) + len(rejected) == 16
    assert len(admitted) >= 4, "2 running + 2 queued must be admitted"
    assert rejected, "16 concurrent streams against 2+2 slots must see 429s"
    for _, events, headers in rejected:
        assert int(headers["retry-after"]) >= 1
    for _, events, _ in admitted:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    one = httpx.post(limited_server.base_url + "/v1/completions",
                     json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
    assert one.status_code == 200


def test_rejection_body_is_an_openai_error(limited_server: ServerProcess) -> None:
    results: list[httpx.Response] = []
    body = {"model": MODEL_NAME, "prompt": "flood", "max_tokens": 32, "ignore_eos": True}

    def one() -> None:
        results.append(httpx.post(limited_server.base_url + "/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    rejected = [r for r in results if r.status_code == 429]
    assert rejected
    for r in rejected:
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"


def test_memory_stays_bounded_under_repeated_overload(limited_server: ServerProcess) -> None:
    _flood(limited_server, 16)  # warm allocator caches first
    before = _rss_kib(limited_server.proc.pid)
    for _ in range(3):
        _flood(limited_server, 16)
    growth = _rss_kib(limited_server.proc.pid) - before
    assert growth < 64 * 1024, f"API process RSS grew {growth} KiB over 48 flooded requests"
