"""Bad input gets a 4xx OpenAI error object, and the server keeps serving after each."""

from __future__ import annotations

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.engine

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    ("malformed json", CMPL, b'{"model": "x", "prompt": ', 400, None),
    ("wrong type prompt", CMPL, {"model": MODEL_NAME, "prompt": 42}, 400, "prompt"),
    ("wrong type max_tokens", CMPL, {"model": MODEL_NAME, "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", CMPL, {"model": MODEL_NAME, "prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", CHAT, {"model": MODEL_NAME, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", CMPL, {"model": MODEL_NAME, "prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    ("prompt longer than context", CMPL, {"model": MODEL_NAME, "prompt": "word " * 5000}, 400, "input_tokens"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "model"),
    ("empty messages", CHAT, {"model": MODEL_NAME, "messages": []}, 400, None),
    ("stream_options without stream", CHAT, {"model": MODEL_NAME, "messages": MSG,
                                             "stream_options": {"include_usage": True}}, 400, None),
    ("temperature out of range", CMPL, {"model": MODEL_NAME, "prompt": "a", "temperature": 9}, 400, "temperature"),
    ("n too large", CMPL, {"model": MODEL_NAME, "prompt": "a", "n": 1000}, 400, "n"),
    ("token id outside vocab", CMPL, {"model": MODEL_NAME, "prompt": [1, 99999999]}, 400, None),
    ("empty prompt", CMPL, {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    ("too many stop strings", CMPL, {"model": MODEL_NAME, "prompt": "a", "stop": ["x"] * 50}, 400, "stop"),
]


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_error_object_and_server_keeps_serving(http: httpx.Client, name: str, path: str, body,
                                                              status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    _assert_openai_error(resp, status, param)
    ok = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "still alive?", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Basic abc"}],
                         ids=["missing", "wrong", "not-bearer"])
def test_api_key_is_required_on_v1(server: ServerProcess, headers: dict) -> None:
    resp = httpx.post(server.base_url + CMPL, json={"model": MODEL_NAME, "prompt": "a"}, headers=headers)
    _assert_openai_error(resp, 401, None)
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key


def test_unknown_route_is_an_error_object(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/nope"), 404, None)


def test_body_over_the_size_limit_is_413(http: httpx.Client) -> None:
    resp = http.post(CMPL, content=b"{" + b" " * (5 * 1024 * 1024) + b"}", headers={"content-type": "application/json"})
    _assert_openai_error(resp, 413, None)
