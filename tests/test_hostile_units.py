"""The request checks against hostile input, one module at a time (no engine, no server)."""

from __future__ import annotations

import json

import pytest

from moe_serve.service import vllm_compat as compat
from moe_serve.service.errors import APIError
from moe_serve.service.grammar_productive import UnknownSyntax, dead_rules
from moe_serve.service.json_body import parse_json_body
from moe_serve.service.metrics import status_for_http
from moe_serve.service.settings import Settings
from moe_serve.service.strict_types import check_strict_types
from moe_serve.service.structured_limits import check_sizes, constraint_specs


def _refused(call, *args) -> APIError:
    with pytest.raises(APIError) as refused:
        call(*args)
    assert refused.value.status == 400
    return refused.value


# --- strict JSON bodies ---

@pytest.mark.parametrize("body,param", [
    (b'{"stop": "\\ud800"}', "stop"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages.0.content"),
    (b'{"logit_bias": {"\\ud800": 1}}', "logit_bias"),
    (b'[["x", "\\uDBFF"]]', "0.1"),
], ids=["string", "nested", "key", "upper-case escape"])
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field(body: bytes, param: str) -> None:
    err = _refused(parse_json_body, body)
    assert err.param == param and "surrogate" in err.message
    json.dumps(err.message).encode()  # the error itself is valid UTF-8


def test_surrogate_pairs_and_escaped_backslashes_are_fine() -> None:
    assert parse_json_body(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001F600", "b": "\\ud800"}


@pytest.mark.parametrize("body,says", [
    (b'{"a": NaN}', "NaN"), (b'{"a": -Infinity}', "-Infinity"), (b'{"a": "\xed\xa0\x80"}', "UTF-8"),
    (b'{"model": "x",\n "prompt": ', "line 2, column 12"), (b"[" * 100_000, "nested too deeply"),
], ids=["NaN", "-Infinity", "encoded surrogate", "truncated", "deep"])
def test_what_is_not_json_is_a_400_saying_why(body: bytes, says: str) -> None:
    err = _refused(parse_json_body, body)
    assert says in err.message and err.param is None and err.code == "invalid_json"


# --- strict booleans, unknown dataclass keys ---

@pytest.mark.parametrize("model,body,param", [
    (compat.CompletionRequest, {"prompt": "x", "stream": "yes"}, "stream"),
    (compat.CompletionRequest, {"prompt": "x", "echo": 1}, "echo"),
    (compat.ChatCompletionRequest, {"messages": [], "add_special_tokens": "false"}, "add_special_tokens"),
    (compat.ChatCompletionRequest, {"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    (compat.ChatCompletionRequest, {"tools": [{"type": "function", "function": {"name": "f", "strict": 0}}]},
     "tools.0.function.strict"),
    (compat.CompletionRequest, {"structured_outputs": {"json_object": "1"}}, "structured_outputs.json_object"),
    (compat.TokenizeCompletionRequest | compat.TokenizeChatRequest, {"prompt": "x", "add_special_tokens": "no"},
     "add_special_tokens"),
])
def test_non_booleans_in_boolean_fields_are_refused(model, body: dict, param: str) -> None:
    err = _refused(check_strict_types, model, body)
    assert err.param == param and err.code == "invalid_type"


def test_unknown_keys_of_structured_outputs_are_refused() -> None:
    err = _refused(check_strict_types, compat.CompletionRequest, {"structured_outputs": {"choice": ["a"], "x": 1}})
    assert err.param == "structured_outputs.x" and err.code == "unknown_parameter"


class _Unwalkable(list):
    """A JSON array that fails the test if it is iterated."""

    def __iter__(self):
        raise AssertionError("the token ids were walked one by one")


@pytest.mark.parametrize("prompt", [_Unwalkable([1, 2, 3]), [_Unwalkable([1, 2]), _Unwalkable([3])]],
                         ids=["ids", "batch of ids"])
def test_a_prompt_of_token_ids_is_not_walked_id_by_id(prompt) -> None:
    # No bool or dataclass field can hide in token ids; walking them id by id delayed the first token.
    check_strict_types(compat.CompletionRequest, {"prompt": prompt, "stream": True})


def test_real_booleans_and_nulls_pass() -> None:
    check_strict_types(compat.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "echo": False, "logprobs": None,
        "structured_outputs": {"json_object": True}, "stream_options": {"include_usage": False}})


# --- grammars that can never finish ---

@pytest.mark.parametrize("ebnf,dead", [
    ("root ::= root", ["root"]),
    ('root ::= "a" x | "b"\nx ::= x', ["x"]),
    ('root ::= (("{" a "}"))\na ::= (("[" a "]"))', ["root", "a"]),  # recursion with no way out
    ('root ::= x{1, -1}\nx ::= "a" x', ["root", "x"]),
    ('root ::= x{0, -1} "z"\nx ::= x "a"', ["x"]),  # root finishes, but a client may enter x
], ids=["self", "optional dead end", "required recursion", "repeat of a dead rule", "optional repeat"])
def test_dead_rules_are_found(ebnf: str, dead: list[str]) -> None:
    assert dead_rules(ebnf) == dead


@pytest.mark.parametrize("ebnf", [
    'root ::= (("a" root) | ("b"))',
    'root ::= Regex("[a-z]+", json_string=true)',
    'root ::= (("[" [ \\n]* "]")) (=([,}\\]:]))',
    'root ::= t\nt ::= TagDispatch(\n  ("<f", g),\n  loop_after_dispatch=true,\n  excludes=()\n)\ng ::= (("x"))',
], ids=["recursion with a base", "regex", "lookahead", "tag dispatch"])
def test_finishing_grammars_pass(ebnf: str) -> None:
    assert dead_rules(ebnf) == []


def test_tag_dispatch_targets_must_finish() -> None:
    assert dead_rules('root ::= t\nt ::= TagDispatch(("<f", g), excludes=())\ng ::= g') == ["g"]


def test_unknown_forms_are_not_guessed() -> None:
    with pytest.raises(UnknownSyntax):
        dead_rules("root ::= a\n")  # `a` undefined
    with pytest.raises(UnknownSyntax):
        dead_rules("root ::= @weird")


# --- structured-output constraints: which ones, and their sizes ---

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y", "z"]}}}


def test_constraints_are_found_wherever_the_engine_compiles_one() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    body = {"structured_outputs": {"regex": "a+", "choice": ["a", "b"], "json_object": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
            "tools": [tool, {**tool, "function": {**tool["function"], "name": "g"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}
    assert [(p, k) for p, k, _ in constraint_specs(body)] == [
        ("structured_outputs.regex", "regex"), ("structured_outputs.choice", "choice"),
        ("response_format.json_schema.schema", "json"), ("tools.1.function.parameters", "json")]
    assert constraint_specs({"tools": [tool], "tool_choice": "auto"}) == []  # nothing constrained
    responses = {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}, "tool_choice": "required",
                 "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}]}
    assert [p for p, _, _ in constraint_specs(responses)] == ["text.format.schema", "tools.0.parameters"]
    assert constraint_specs({"structured_outputs": {"choice": [1, 2]}}) == []  # pydantic's 400 to give


def test_sizes_and_entries_are_bounded() -> None:
    settings = Settings(max_structured_output_bytes=1000, max_structured_output_choices=5)
    check_sizes(constraint_specs({"structured_outputs": {"json": SCHEMA}}), settings)
    big = {"structured_outputs": {"regex": "a" * 1001}}
    err = _refused(check_sizes, constraint_specs(big), settings)
    assert err.param == "structured_outputs.regex" and "1000 bytes" in err.message
    nested = {"anyOf": [SCHEMA, {"enum": [1, 2, 3]}]}  # 6 enum values in two places
    err = _refused(check_sizes, constraint_specs({"structured_outputs": {"json": json.dumps(nested)}}), settings)
    assert "6 enum values" in err.message and "at most 5" in err.message
    err = _refused(check_sizes, constraint_specs({"structured_outputs": {"choice": list("abcdef")}}), settings)
    assert "6 choices" in err.message


# --- outcomes of refused requests in moe_serve_requests_total ---

@pytest.mark.parametrize("status,label", [(200, "ok"), (400, "client_error"), (401, "client_error"),
                                          (413, "client_error"), (429, "rejected"), (499, "aborted"),
                                          (None, "aborted"), (500, "server_error")])
def test_every_status_has_an_outcome(status: int | None, label: str) -> None:
    assert status_for_http(status) == label
