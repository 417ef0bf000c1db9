"""Nothing is accepted and silently dropped: unknown fields are 400s naming them (at any depth),
the documented allowlist is accepted, and 5xx-prone inputs of the old server are clean 400s."""

from __future__ import annotations

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME

pytestmark = pytest.mark.engine
CMPL = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

UNKNOWN = [
    ("completions top level", "/v1/completions", {**CMPL, "best_of_n": 2}, "best_of_n"),
    ("legacy functions", "/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("nested stream_options", "/v1/chat/completions",
     {**CHAT, "stream": True, "stream_options": {"include_usage": True, "usage_every": 1}},
     "stream_options.usage_every"),
    ("nested tool function", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]},
     "tools.0.function.paramters"),
    ("tokenize", "/tokenize", {"model": MODEL_NAME, "prompt": "Hi", "add_bos": True}, "add_bos"),
]


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("name,path,body,param", UNKNOWN, ids=[c[0] for c in UNKNOWN])
def test_unknown_fields_are_a_400_naming_them(http: httpx.Client, name: str, path: str, body: dict,
                                              param: str) -> None:
    err = _error(http.post(path, json=body), 400)
    assert err["param"] == param and err["code"] == "unknown_parameter"


@pytest.mark.parametrize("extra", [{"user": "u-1"}, {"metadata": {"k": "v"}}, {"store": False},
                                   {"service_tier": "auto"}, {"safety_identifier": "s"}, {"prompt_cache_key": "p"}])
def test_allowlisted_fields_are_accepted(http: httpx.Client, extra: dict) -> None:
    assert http.post("/v1/chat/completions", json={**CHAT, **extra}).status_code == 200


def test_model_may_be_omitted_as_in_vllm_serve(http: httpx.Client) -> None:
    body = {k: v for k, v in CMPL.items() if k != "model"}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.json()["model"] == MODEL_NAME


@pytest.mark.parametrize("body", [
    {**CMPL, "n": 2, "temperature": 0},  # the old server: 500 (vLLM's VLLMValidationError)
    {**CMPL, "seed": 2**64},  # the old server: 500 and one engine request leaked per call
    {**CMPL, "seed": -(2**63) - 1},
    {**CMPL, "logit_bias": {"32000": 1.0}},  # outside the vocabulary
    {**CMPL, "stop_token_ids": [32000]},
], ids=["greedy n>1", "seed too large", "seed too small", "oov logit_bias", "oov stop_token_ids"])
def test_former_5xx_and_unchecked_inputs_are_400_and_leak_nothing(http: httpx.Client, body: dict) -> None:
    for _ in range(3):
        _error(http.post("/v1/completions", json=body), 400)
    health = http.get("/health").json()
    assert health["unfinished_requests"] == 0 and health["running"] == 0


def test_tool_choice_required_without_tools_is_a_400(http: httpx.Client) -> None:
    _error(http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"}), 400)


def test_tool_choice_none_with_tools_returns_text(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "tool_choice": "none"})
    assert resp.status_code == 200
    message = resp.json()["choices"][0]["message"]
    assert message["content"] and not message.get("tool_calls")
