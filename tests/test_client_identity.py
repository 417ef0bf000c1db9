"""Who a request is: the start-up warm-up is recognised by a mark only the server process can
put in the request's ASGI scope, never by anything a client sends; proxy headers rewrite the
client address only from a proxy named by --forwarded-allow-ips."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess
from moe_serve.service.warmup import warmup_requests
from tests.conftest import STRICT_METRICS_KEY
from tests.monitoring_helpers import delta, scrape

pytestmark = pytest.mark.engine
WARMUP_REQUESTS = len(warmup_requests(MODEL_NAME))
WARMUP_COMPLETIONS = sum(path == "/v1/completions" for _, path, _ in warmup_requests(MODEL_NAME))
SPOOFS = ({"X-Forwarded-For": "moe-serve-warmup"}, {"X-Forwarded-For": "moe-serve-warmup, 127.0.0.1"},
          {"Forwarded": "for=moe-serve-warmup"}, {"X-Real-IP": "moe-serve-warmup"},
          {"X-Forwarded-For": "moe-serve-warmup", "X-Forwarded-Proto": "https", "X-Moe-Serve-Warmup": "1",
           "User-Agent": "moe-serve-warmup", "Host": "moe-serve-warmup"})


def _wait_for_lines(srv: ServerProcess, match, count: int, timeout: float = 10.0) -> list[str]:
    """Log lines for which `match(line)` holds, once there are `count` (access lines follow the response)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in srv.log().splitlines() if match(line)]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def _complete(srv: ServerProcess, headers: dict[str, str], model: str) -> None:
    resp = httpx.post(srv.base_url + "/v1/completions", headers={**srv.headers, **headers}, timeout=60,
                      json={"model": model, "prompt": "who am I?", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_spoofed_warmup_headers_are_counted_and_logged_with_the_real_peer(server: ServerProcess) -> None:
    """Proxy headers off (the default): each spoof is one more client request in /metrics, logged
    from 127.0.0.1; the access log keeps exactly the start-up warm-up's lines."""
    def warm(line: str) -> bool:
        return " moe_serve.access: moe-serve-warmup " in line

    def peer(line: str) -> bool:
        return " moe_serve.access: 127.0.0.1 POST /v1/completions 200 " in line

    assert len(_wait_for_lines(server, warm, WARMUP_REQUESTS)) == WARMUP_REQUESTS
    logged_before = len(_wait_for_lines(server, peer, 0))
    before = scrape(server.base_url, server.headers)
    for headers in SPOOFS:
        _complete(server, headers, MODEL_NAME)
    after = scrape(server.base_url, server.headers)
    assert delta(before, after, "moe_serve_requests_total", status="ok") == len(SPOOFS)
    assert delta(before, after, "moe_serve_prompt_tokens_total") > 0
    assert len(_wait_for_lines(server, peer, logged_before + len(SPOOFS))) == logged_before + len(SPOOFS)
    assert len(_wait_for_lines(server, warm, WARMUP_REQUESTS, timeout=0)) == WARMUP_REQUESTS


def test_a_trusted_proxy_names_the_client_but_cannot_make_a_request_warmup(strict_server: ServerProcess,
                                                                          embedded_model_dir: str) -> None:
    """--forwarded-allow-ips 127.0.0.1: X-Forwarded-For names the client in the access log, even
    `moe-serve-warmup`, and the request is still counted like any other."""
    model = Path(embedded_model_dir).name
    metrics_auth = {"Authorization": f"Bearer {STRICT_METRICS_KEY}"}
    before = scrape(strict_server.base_url, metrics_auth)
    for client in ("203.0.113.7", "moe-serve-warmup"):
        _complete(strict_server, {"X-Forwarded-For": client}, model)
    after = scrape(strict_server.base_url, metrics_auth)
    assert delta(before, after, "moe_serve_requests_total", status="ok") == 2

    def record(line: str) -> dict:
        return json.loads(line) if line.startswith('{"ts"') else {}

    def forwarded(line: str) -> bool:
        return record(line).get("client") in ("203.0.113.7", "moe-serve-warmup") and \
            record(line).get("path") == "/v1/completions"

    clients = [record(line)["client"] for line in _wait_for_lines(strict_server, forwarded, WARMUP_COMPLETIONS + 2)]
    # the forwarded two, and the warm-up's own completions
    assert sorted(clients) == ["203.0.113.7"] + ["moe-serve-warmup"] * (WARMUP_COMPLETIONS + 1), clients
