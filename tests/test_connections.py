"""Connection-level guards: header size and read time, body read time, protocol garbage, HEAD probes.

The timing guards run against the real app under uvicorn with moe-serve's protocol class in this
process, with 1 s timeouts and no engine (lifespan off: the checks act before any route needs
one); sizes, garbage and HEAD also against the real server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from moe_serve.loadtest.server_proc import ServerProcess, free_port
from moe_serve.service.app import create_app
from moe_serve.service.http_protocol import guarded_protocol
from moe_serve.service.settings import Settings

TIMEOUT_S = 1.0
SMALL_HEADERS = 4096
WAIT_S = 30.0  # upper bound for an answer that should come after TIMEOUT_S


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[str, int]]:
    """(host, port) of the app served by uvicorn with 1 s header/body timeouts, 4 KiB headers."""
    settings = Settings(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_header_bytes=SMALL_HEADERS,
                        access_log=False)
    app = create_app(settings, "/unused")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                                           http=guarded_protocol(SMALL_HEADERS, TIMEOUT_S)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(30)
    app.state.server.cleanup()


def _exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Send `data`, then read until the server closes the connection (at most WAIT_S)."""
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _error_answer(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:300]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_headers_over_the_limit_get_431(guarded: tuple[str, int]) -> None:
    request = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * SMALL_HEADERS + b"\r\n\r\n"
    error = _error_answer(_exchange(guarded, request), 431)
    assert error["code"] == "request_header_fields_too_large" and str(SMALL_HEADERS) in error["message"]


def test_headers_that_never_finish_get_408_and_the_connection_closes(guarded: tuple[str, int]) -> None:
    error = _error_answer(_exchange(guarded, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: a"), 408)
    assert error["code"] == "timeout" and "headers" in error["message"]


def test_a_connection_that_sends_nothing_is_closed(guarded: tuple[str, int]) -> None:
    assert _exchange(guarded, b"") == b""


def test_a_body_shorter_than_its_content_length_gets_408(guarded: tuple[str, int]) -> None:
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
    error = _error_answer(_exchange(guarded, request), 408)
    assert error["code"] == "timeout" and "body" in error["message"]


def test_protocol_garbage_gets_an_error_object(guarded: tuple[str, int]) -> None:
    assert _error_answer(_exchange(guarded, b"\x16\x03\x01 not http at all\r\n\r\n"), 400)["code"] == \
        "invalid_http_request"


def test_ordinary_requests_pass_the_guards_on_a_kept_alive_connection(guarded: tuple[str, int]) -> None:
    host, port = guarded
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=WAIT_S) as client:
        assert client.get("/ping").json() == {"status": "alive"}
        time.sleep(TIMEOUT_S * 1.5)  # idle between requests: keep-alive's business, not the header timer's
        body = client.post("/v1/completions", json={"prompt": "x"})
        assert body.status_code == 503 and body.json()["error"]["code"] == "engine_starting"


# --- the real server ---

@pytest.mark.engine
@pytest.mark.parametrize("path", ["/health", "/ping"])
def test_head_probes_answer_like_get_without_a_body(server: ServerProcess, path: str) -> None:
    got = httpx.get(server.base_url + path)
    head = httpx.head(server.base_url + path)
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


@pytest.mark.engine
def test_real_server_refuses_a_huge_header_and_garbage_with_error_objects(server: ServerProcess) -> None:
    address = ("127.0.0.1", server.port)
    huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n"
    assert _error_answer(_exchange(address, huge), 431)["code"] == "request_header_fields_too_large"
    assert _error_answer(_exchange(address, b"BREW /pot HTCPCP/1.0\r\n\r\n"), 400)["code"] == "invalid_http_request"
    assert httpx.get(server.base_url + "/health").status_code == 200
