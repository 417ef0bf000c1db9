"""Hostile request bodies against the real server: each is a 400 OpenAI error object naming the
field, registers nothing with the engine, and the server keeps serving."""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess
from tests.test_grammar_checker import pattern_schema

pytestmark = pytest.mark.engine
M = json.dumps(MODEL_NAME)
S = '"\\ud800"'  # a lone surrogate, as the JSON escape a client sends
MSG = '[{"role": "user", "content": "hi"}]'
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text[:500]
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _unfinished(http: httpx.Client) -> int:
    return http.get("/health").json()["unfinished_requests"]


SURROGATE_CASES = [
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "stop": {S}}}', "stop"),
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "stream": true, "stop": {S}}}', "stop"),
    (CHAT, f'{{"model": {M}, "messages": {MSG}, "max_tokens": 2, "stop": [{S}]}}', "stop.0"),
    (CHAT, f'{{"model": {M}, "messages": {MSG}, "max_tokens": 2, "stream": true, "stop": [{S}]}}', "stop.0"),
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "bad_words": [{S}]}}', "bad_words.0"),
    (CMPL, f'{{"model": {S}, "prompt": "hi", "max_tokens": 2}}', "model"),
    (CMPL, f'{{"model": {M}, "prompt": {S}, "max_tokens": 2}}', "prompt"),
    (CHAT, f'{{"model": {M}, "messages": [{{"role": "user", "content": {S}}}], "max_tokens": 2}}',
     "messages.0.content"),
    (CHAT, f'{{"model": {M}, "messages": [{{"role": "user", "name": {S}, "content": "hi"}}], "max_tokens": 2}}',
     "messages.0.name"),
    (CHAT, f'{{"model": {M}, "messages": {MSG}, "max_tokens": 2, "tools": [{{"type": "function", '
           f'"function": {{"name": {S}, "parameters": {{}}}}}}]}}', "tools.0.function.name"),
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "user": {S}}}', "user"),
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "logit_bias": {{{S}: 1}}}}', "logit_bias"),
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "structured_outputs": {{"regex": {S}}}}}',
     "structured_outputs.regex"),
    (CMPL, f'{{"model": {M}, "prompt": "hi", "max_tokens": 2, "structured_outputs": {{"choice": ["a", {S}]}}}}',
     "structured_outputs.choice.1"),
    (CHAT, f'{{"model": {M}, "messages": {MSG}, "max_tokens": 2, "response_format": {{"type": "json_schema", '
           f'"json_schema": {{"name": "x", "schema": {{"enum": [{S}]}}}}}}}}',
     "response_format.json_schema.schema.enum.0"),
    ("/tokenize", f'{{"model": {M}, "prompt": {S}}}', "prompt"),
]


@pytest.mark.parametrize("path,text,param", SURROGATE_CASES, ids=[c[2] + (" stream" if "stream" in c[1] else "")
                                                                   for c in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400_and_registers_nothing(http: httpx.Client, path: str, text: str,
                                                         param: str) -> None:
    idle = _unfinished(http)
    for _ in range(3):  # the old server leaked one engine request per call for `stop`
        err = _error(_post_raw(http, path, text))
        assert err["param"] == param and "surrogate" in err["message"]
    assert _unfinished(http) == idle
    assert http.post(CMPL, json={"model": MODEL_NAME, "prompt": "still fine", "max_tokens": 2}).status_code == 200


def _schema_chat(schema, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **extra}


REF_SELF = {"$ref": "#"}
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
DEAD_OPTIONAL = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"$ref": "#/$defs/x"}}}
NEVER_FINISHING = [
    (CHAT, _schema_chat(REF_SELF), "response_format.json_schema.schema"),
    (CHAT, _schema_chat(REF_SELF, stream=True), "response_format.json_schema.schema"),
    (CHAT, _schema_chat(REF_CYCLE), "response_format.json_schema.schema"),
    (CHAT, _schema_chat(DEAD_OPTIONAL), "response_format.json_schema.schema"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 8, "structured_outputs": {"json": REF_CYCLE}},
     "structured_outputs.json"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 8,
            "structured_outputs": {"json": json.dumps(REF_SELF)}}, "structured_outputs.json"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 8, "structured_outputs": {"grammar": "root ::= root"}},
     "structured_outputs.grammar"),
    (CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 8, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": REF_SELF}}]},
     "tools.0.function.parameters"),
    (CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 8, "response_format": {
        "type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
            {"begin": "<f>", "content": {"type": "json_schema", "json_schema": REF_CYCLE}, "end": "</f>"}]}}},
     "response_format"),
]


@pytest.mark.parametrize("path,body,param", NEVER_FINISHING,
                         ids=["$ref #", "$ref # stream", "$ref cycle", "dead optional property", "completions",
                              "schema as a string", "grammar", "required tool", "structural tag"])
def test_constraints_that_can_never_finish_are_a_400_up_front(http: httpx.Client, path: str, body: dict,
                                                              param: str) -> None:
    idle = _unfinished(http)
    err = _error(http.post(path, json=body))
    assert err["param"] == param and "no finite output" in err["message"]
    assert _unfinished(http) == idle


def test_a_recursive_schema_that_can_finish_is_served(http: httpx.Client) -> None:
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}}}
    resp = http.post(CHAT, json=_schema_chat(tree))
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("body,param,says", [
    (_schema_chat({"enum": [f"value-{i}" for i in range(100_000)]}), "response_format.json_schema.schema",
     "bytes"),
    (_schema_chat({"enum": [f"v{i}" for i in range(5000)]}), "response_format.json_schema.schema", "5000 enum values"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
      "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}, "structured_outputs.choice", "bytes"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
      "structured_outputs": {"choice": [f"c{i}" for i in range(5000)]}}, "structured_outputs.choice", "5000 choices"),
], ids=["100k enum", "5k enum", "100k choice", "5k choice"])
def test_oversized_constraints_are_refused_naming_the_limit(http: httpx.Client, body: dict, param: str,
                                                            says: str) -> None:
    err = _error(http.post(CMPL if "prompt" in body else CHAT, json=body))
    assert err["param"] == param and says in err["message"] and err["code"] == "structured_output_too_large"
    assert "--max-structured-output-" in err["message"]


SLOW_TO_CONVERT = {"type": "string", "pattern": "^[a-z]{1,30000}$"}  # minutes for xgrammar to convert


def test_a_constraint_over_the_conversion_budget_is_refused(http: httpx.Client) -> None:
    """The checker kills the conversion at the budget (3 s of CPU); the same schema again is refused
    at once (the verdict is cached) and the engine never saw it."""
    idle = _unfinished(http)
    for _ in range(2):
        err = _error(http.post(CHAT, json=_schema_chat(SLOW_TO_CONVERT)))
        assert err["code"] == "structured_output_too_complex" and err["param"] == "response_format.json_schema.schema"
        assert "--structured-output-compile-budget" in err["message"]
    assert _unfinished(http) == idle


def test_a_schema_whose_compile_takes_seconds_is_served(http: httpx.Client) -> None:
    """900 pattern properties (64 KB): seconds of xgrammar compile for the embedded model's vocabulary
    (no free whitespace), over the conversion budget as a compile, yet converted in milliseconds: the
    check passes it and the engine's compile serves it, as under `vllm serve` (tests/test_grammar_checker.py
    shows the verdict is the same on a loaded core)."""
    schema = pattern_schema(900, tag=random.randrange(1, 1 << 20))    # new to the engine's grammar cache
    resp = http.post(CHAT, json=_schema_chat(schema), timeout=300)
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["choices"][0]["message"]["content"].startswith('{"p0":"')


@pytest.mark.parametrize("text,param,says", [
    (f'{{"model": {M}, "prompt": "x", "logit_bias": {{"5": 1e308}}}}', "logit_bias", "[-100, 100]"),
    (f'{{"model": {M}, "prompt": "x", "logit_bias": {{"5": -1e999}}}}', "logit_bias", "-inf"),
    (f'{{"model": {M}, "prompt": "x", "logit_bias": {{"5": 100.5}}}}', "logit_bias", "[-100, 100]"),
    (f'{{"model": {M}, "prompt": "x", "logit_bias": {{"5": NaN}}}}', None, "NaN is not a JSON value"),
    (f'{{"model": {M}, "prompt": "x", "temperature": Infinity}}', None, "Infinity is not a JSON value"),
    (f'{{"model": {M}, "prompt": "x", "structured_outputs": {{"choice": ["a"], "choise": ["b"]}}}}',
     "structured_outputs.choise", "unknown field"),
    (f'{{"model": {M}, "prompt": "x", "stream": "yes"}}', "stream", "must be a boolean"),
    (f'{{"model": {M}, "prompt": "x", "echo": "true"}}', "echo", "must be a boolean"),
    (f'{{"model": {M}, "prompt": "x", "add_special_tokens": 0}}', "add_special_tokens", "must be a boolean"),
    (f'{{"model": {M}, "messages": {MSG}, "logprobs": "1"}}', "logprobs", "must be a boolean"),
    (f'{{"model": {M}, "messages": {MSG}, "stream": true, "stream_options": {{"include_usage": "yes"}}}}',
     "stream_options.include_usage", "must be a boolean"),
], ids=["bias 1e308", "bias -inf", "bias 100.5", "bias NaN", "Infinity", "structured_outputs typo", "stream",
        "echo", "add_special_tokens", "chat logprobs", "include_usage"])
def test_values_pydantic_would_coerce_or_vllm_would_clamp_are_refused(http: httpx.Client, text: str,
                                                                      param: str | None, says: str) -> None:
    path = CHAT if '"messages"' in text else CMPL
    err = _error(_post_raw(http, path, text))
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("seed,error_type", [(2**64, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")])
def test_seed_out_of_range_names_pydantics_error_type_as_vllm_serve_does(http: httpx.Client, seed: int,
                                                                         error_type: str) -> None:
    err = _error(http.post(CHAT, json={"model": MODEL_NAME, "messages": USER, "seed": seed}))
    assert err["param"] == "seed" and error_type in err["message"]


@pytest.mark.parametrize("field,value,says", [
    ("truncate_prompt_tokens", -3, "greater than or equal to -1 [type=greater_than_equal]"),  # pydantic's range
    ("temperature", 9, "temperature must be in [0, 2], got 9.0."),  # vLLM's own checks, word for word
    ("top_k", -5, "top_k must be 0 (disable), or at least 1, got -5."),
    ("presence_penalty", 5, "presence_penalty must be in [-2, 2], got 5.0."),
])
def test_other_range_errors_keep_vllms_wording(http: httpx.Client, field: str, value: int, says: str) -> None:
    err = _error(http.post(CMPL, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, field: value}))
    assert says in err["message"] and err["param"] in (field, None), err


def test_a_malformed_body_names_line_and_column_not_an_offset(http: httpx.Client) -> None:
    err = _error(_post_raw(http, CMPL, '{"model": "x",\n "prompt": '))
    assert err["param"] is None and "line 2, column 12" in err["message"]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _checker_pid(server_pid: int) -> int:
    return next(p for p in _children(server_pid)
                if b"moe_serve.service.grammar_worker" in Path(f"/proc/{p}/cmdline").read_bytes())


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_slow_check_stalls_no_one_and_a_client_that_disconnects_cancels_it(
        strict_server: ServerProcess, embedded_model_dir: str) -> None:
    """On the strict server (300 s budget) a schema that takes minutes to convert is being
    checked in a forked child: another structured request is checked and served meanwhile; then
    the slow one's client hangs up and the child is killed long before any budget."""
    checker = _checker_pid(strict_server.proc.pid)
    model = Path(embedded_model_dir).name
    body = json.dumps({**_schema_chat({"type": "string", "pattern": "^[a-z]{1,40000}$"}), "model": model}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: " + strict_server.headers["Authorization"].encode() +
               b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=30) as sock:
        sock.sendall(request)
        assert _until(lambda: _children(checker), 60), "the check never started"
        slow_child = _children(checker)
        other = httpx.post(strict_server.base_url + CHAT, headers=strict_server.headers, timeout=120, json={
            **_schema_chat({"type": "object", "properties": {"n": {"type": "integer"}}}), "model": model})
        assert other.status_code == 200, other.text
        assert set(slow_child) <= set(_children(checker)), "the slow check ended before the other request"
    assert _until(lambda: not set(slow_child) & set(_children(checker)), 60), \
        "the check kept running after the client left"
    assert _checker_pid(strict_server.proc.pid) == checker  # the checker itself lives on


HUGE_BODIES = [  # vLLM's validators quote the whole value in their message; the line that names the fault
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
            "logit_bias": {str(5_000_000 + i): 1 for i in range(300_000)}}, "logit_bias", "5000017",
     "request rejected: 400 - (VLLMValidationError), field logit_bias, message of"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
            "bad_words": [f"zqword{i}" for i in range(100_000)]}, "bad_words", "zqword17",
     "request rejected: 400 - (VLLMValidationError), field bad_words, message of"),
    (CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "stream": True,  # vLLM's stream generator
            "bad_words": [f"zqword{i}" for i in range(100_000)]}, "bad_words", "zqword17",  # logs it with its traceback
     "Error in chat completion stream generator. [a client's fault: VLLMValidationError, message of"),
]


@pytest.mark.parametrize("path,body,field,client_string,line", HUGE_BODIES,
                         ids=["logit_bias", "bad_words", "chat stream"])
def test_a_huge_rejected_value_adds_one_bounded_line_to_the_log(server: ServerProcess, http: httpx.Client, path: str,
                                                                body: dict, field: str, client_string: str,
                                                                line: str) -> None:
    """Under 1 KB of log per request, none of the client's strings; the answer's echo bounded."""
    time.sleep(1.0)  # past the rejection lines' interval: this one is logged
    before = server.log_path.stat().st_size
    resp = http.post(path, json=body)
    err = _error(resp)
    assert err["param"] == field and err["message"].endswith("characters)") and len(resp.content) < 3000
    time.sleep(0.3)  # the access log's line, written once the response went out
    with server.log_path.open("rb") as log:
        log.seek(before)
        added = log.read().decode(errors="replace")
    assert len(added.encode()) < 1024, added[:2000]
    assert client_string not in added and line in added, added
