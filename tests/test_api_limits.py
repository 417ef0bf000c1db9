"""Request fan-out, input caps and the default output cap (issue 18 items 2 and 9), and that
tokenization runs off the event loop and after admission (item 3), on real servers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.server_proc import MODEL_NAME, ServerProcess, start_server

pytestmark = pytest.mark.engine
# 2 slots, no queue: a third concurrent sequence is refused at once.
FLAGS = ["--max-concurrent-requests", "2", "--max-queued-requests", "0", "--max-batch-prompts", "4",
         "--default-max-tokens", "8", "--max-messages", "3"]
BIG_PROMPT = "hello world, this is a longer sentence. " * 97000  # 3.9 MB: ~6 s to tokenize here
LONG_STREAM = {"model": MODEL_NAME, "prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True,
               "stream": True}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(Path(tmp_path_factory.mktemp("limits")), *FLAGS)
    yield srv
    srv.stop()


def _post(server: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=timeout)


def _error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return err


def test_batch_over_max_batch_prompts_is_a_400(small: ServerProcess) -> None:
    _error(_post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": ["a"] * 5, "max_tokens": 1}), 400,
           "prompt")


def test_prompts_times_n_over_the_slot_limit_is_a_400(small: ServerProcess) -> None:
    _error(_post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b"], "n": 2, "max_tokens": 1,
                                            "temperature": 1.0}), 400, "n")
    ok = _post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b"], "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_batch_takes_one_slot_per_prompt(small: ServerProcess) -> None:
    """While a 2-prompt batch streams it holds both slots: a one-prompt request gets 429 at once."""
    body = {**LONG_STREAM, "prompt": ["one", "two"]}
    with httpx.stream("POST", small.base_url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        assert httpx.get(small.base_url + "/health").json()["running"] == 2
        began = time.monotonic()
        refused = _post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        _error(refused, 429, None)
        assert refused.headers["retry-after"] and time.monotonic() - began < 2
    deadline = time.monotonic() + 10  # the closed stream is aborted and its slots released
    while httpx.get(small.base_url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_refused_request_is_never_tokenized(small: ServerProcess) -> None:
    """Admission comes first: a maximum-size prompt refused with 429 is answered at once, without
    the seconds its tokenization takes (measured by the same prompt admitted: a 400 for length)."""
    with httpx.stream("POST", small.base_url + "/v1/completions", json={**LONG_STREAM, "prompt": ["a", "b"]},
                      timeout=120) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: {"))
        began = time.monotonic()
        _error(_post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": BIG_PROMPT}), 429, None)
        refused_s = time.monotonic() - began
    time.sleep(1.0)
    began = time.monotonic()
    _error(_post(small, "/v1/completions", {"model": MODEL_NAME, "prompt": BIG_PROMPT}), 400, "input_tokens")
    admitted_s = time.monotonic() - began
    assert admitted_s > 1.0, "the prompt must take measurable time to tokenize for this test to mean anything"
    assert refused_s < admitted_s / 3, (refused_s, admitted_s)


def test_default_output_cap_applies_without_max_tokens(small: ServerProcess) -> None:
    chat = _post(small, "/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                                                 "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
    explicit = _post(small, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 12, "ignore_eos": True,
                                                     "messages": [{"role": "user", "content": "x"}]})
    assert explicit.json()["usage"]["completion_tokens"] == 12  # an explicit value is not capped by the default


def test_too_many_messages_is_a_400(small: ServerProcess) -> None:
    messages = [{"role": "user", "content": "x"}] * 4
    _error(_post(small, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages}), 400, "messages")


def test_a_maximum_size_prompt_does_not_stall_other_streams(server: ServerProcess) -> None:
    """Tokenizing a ~4 MB prompt takes seconds; meanwhile a running stream keeps its pace."""
    arrivals: list[float] = []
    big: dict = {}

    def send_big() -> None:
        big["began"] = time.monotonic()
        big["status"] = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": BIG_PROMPT}).status_code
        big["ended"] = time.monotonic()

    sender = threading.Thread(target=send_big)
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**LONG_STREAM, "max_tokens": 4000},
                      headers=server.headers, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            assert "error" not in json.loads(line[6:])
            if len(arrivals) == 20:
                sender.start()
            if "ended" in big and arrivals[-1] > big["ended"] + 0.2:
                break  # closing the stream aborts it
    sender.join(120)
    assert big["status"] == 400  # longer than the context: rejected after tokenization
    window = (big["began"] + 0.2, big["ended"])
    assert window[1] - window[0] > 1.0, "tokenization must overlap the stream for this test to mean anything"
    inside = [t for t in arrivals if window[0] <= t <= window[1]]
    assert len(inside) >= 3, "the stream must go on while the prompt is tokenized"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if window[0] <= b <= window[1]]
    assert max(gaps) < 0.5, f"a stream stalled {max(gaps):.2f} s while a big prompt was tokenized"
