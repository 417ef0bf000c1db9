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

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server

pytestmark = pytest.mark.engine
# 64 slots, no queue: a request that does not fit is refused at once.
FLAGS = ["--max-concurrent-requests", "64", "--max-queued-requests", "0", "--max-batch-prompts", "64",
         "--default-max-tokens", "8", "--max-messages", "3"]
# The most tokenization one request can ask for: vLLM tokenizes at most max_model_len x (longest token)
# = 65,536 characters of a prompt here (longer text is a 400 before tokenization), and a 4 MiB body
# holds 60 such prompts: over a second of tokenizing on a 2-core CI machine, in vLLM's one-thread tokenizer pool.
BIG_BATCH = ["hello world, this is a longer sentence. " * 1550] * 60  # 62,000 characters each
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
    assert resp.status_code == status, resp.text[:300]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return err


def _one(prompt: str | list[str] = "x") -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}


def _marker_seconds(server: ServerProcess) -> float:
    """How long a tiny /tokenize waits for vLLM's tokenizer pool (long while a big batch is in it)."""
    began = time.monotonic()
    assert _post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "marker"}).status_code == 200
    return time.monotonic() - began


def _wait_idle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 15
    while httpx.get(server.base_url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)


def test_batch_over_max_batch_prompts_is_a_400(small: ServerProcess) -> None:
    _error(_post(small, "/v1/completions", _one(["a"] * 65)), 400, "prompt")


def test_prompts_times_n_over_the_slot_limit_is_a_400(small: ServerProcess) -> None:
    _error(_post(small, "/v1/completions", {**_one(["a"] * 8), "n": 9, "temperature": 1.0}), 400, "n")
    ok = _post(small, "/v1/completions", {**_one(["a"] * 8), "n": 8, "temperature": 1.0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


def test_a_batch_takes_one_slot_per_prompt(small: ServerProcess) -> None:
    """While an 8-prompt batch streams it holds 8 of the 64 slots: 56 more fit, 57 are refused."""
    with httpx.stream("POST", small.base_url + "/v1/completions", json={**LONG_STREAM, "prompt": ["s"] * 8},
                      timeout=120) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the connection (and aborts the stream)
        next(line for line in lines if line.startswith("data: {"))
        assert httpx.get(small.base_url + "/health").json()["running"] == 8
        began = time.monotonic()
        refused = _post(small, "/v1/completions", _one(["x"] * 57))
        _error(refused, 429, None)
        assert int(refused.headers["retry-after"]) >= 1 and time.monotonic() - began < 2
        assert _post(small, "/v1/completions", _one(["x"] * 56)).status_code == 200
    _wait_idle(small)  # the closed stream was aborted and its slots released
    assert httpx.get(small.base_url + "/health").json()["unfinished_requests"] == 0


def _marker_during(server: ServerProcess, body: dict) -> tuple[httpx.Response, float]:
    """The response to `body`, and _marker_seconds() taken MARKER_AFTER_S after it was sent (while a
    request admitted to tokenization still holds the pool, whenever its own response comes)."""
    out: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: out.setdefault("r", _post(server, "/v1/completions", body)))
    sender.start()
    time.sleep(MARKER_AFTER_S)
    marker = _marker_seconds(server)
    sender.join(180)
    return out["r"], marker


MARKER_AFTER_S = 0.1


def test_a_refused_request_is_never_tokenized(small: ServerProcess) -> None:
    """Admission comes before tokenization: the biggest batch refused with 429 leaves vLLM's
    tokenizer pool idle; admitted (then a 400 for its length), it keeps the pool busy for seconds."""
    with httpx.stream("POST", small.base_url + "/v1/completions", json={**LONG_STREAM, "prompt": ["s"] * 8},
                      timeout=120) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the connection (and aborts the stream)
        next(line for line in lines if line.startswith("data: {"))
        refused, after_refused = _marker_during(small, _one(BIG_BATCH))
        _error(refused, 429, None)
    _wait_idle(small)
    admitted, after_admitted = _marker_during(small, _one(BIG_BATCH))
    _error(admitted, 400, "input_tokens")
    print(f"marker /tokenize: {after_refused:.3f} s beside the refused batch, {after_admitted:.3f} s beside the admitted one")
    assert after_admitted > 0.25, "the batch must take measurable time to tokenize for this test to mean anything"
    assert after_refused < after_admitted / 4, (after_refused, after_admitted)


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
    """While the biggest batch is tokenized (seconds), a running stream goes on: tokenized on the
    event loop, the batch would hold every token of the stream back for the whole tokenization, so
    no gap may come near the tokenization's own length (measured here, on however busy a machine)."""
    arrivals: list[float] = []
    big: dict = {}

    def send_big() -> None:
        big["began"] = time.monotonic()
        big["status"] = _post(server, "/v1/completions", _one(BIG_BATCH)).status_code
        big["pool_drained"] = big["began"] + 0.05 + _marker_seconds(server)  # queued behind the batch

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
            if "pool_drained" in big and arrivals[-1] > big["pool_drained"] + 0.2:
                break  # closing the stream aborts it
    sender.join(120)
    assert big["status"] == 400  # longer than the context: rejected after tokenization
    window = (big["began"] + 0.2, time.monotonic() if "pool_drained" not in big else big["pool_drained"])
    assert window[1] - window[0] > 1.0, "tokenization must overlap the stream for this test to mean anything"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if window[0] <= b <= window[1]]
    assert len(gaps) >= 3, "the stream must go on while the batch is tokenized"
    tokenizing = window[1] - window[0]
    assert max(gaps) < tokenizing / 2, f"a stream stalled {max(gaps):.2f} s while a big batch was tokenized " \
        f"for {tokenizing:.2f} s"
