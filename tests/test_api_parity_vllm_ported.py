"""vLLM's own OpenAI entrypoint tests, ported to our server fixture (real engine, embedded model).

Written from reading vllm-project/vllm tests/entrypoints/openai/completion/test_completion.py,
.../chat_completion/test_chat.py, .../chat_completion/test_completion_with_function_calling.py and
tests/entrypoints/serve/tokenize/test_tokenization.py; each test names its original in a comment.
Adapted for a random-weight model, whose greedy text differs between CPU kinds (oneDNN paths):
no assertion on what the text says (e.g. "1+1 = 2") or that it is non-empty, `ignore_eos` wherever
a token count is asserted (greedy decoding may pick EOS early on one CPU and not on another), no
"the second sample differs from the first" checks that only a trained model makes reliable;
schemas are finite (enums, bounded lengths) so a constrained random model completes them.
The original parametrisation over a LoRA adapter is dropped (no LoRA here).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from functools import lru_cache

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.engine

CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
IP_REGEX = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
EMPLOYEE_SCHEMA = {  # vLLM's sample_json_schema, with finite values
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Alan", "Grace", "Linus"]},
        "age": {"type": "integer", "enum": [25, 30, 41, 52]},
        "skills": {"type": "array", "items": {"type": "string", "enum": ["C", "Go", "SQL"]}, "maxItems": 2},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
SYSTEM = {"role": "system", "content": "you are a helpful assistant"}
ONE_PLUS_ONE = [SYSTEM, {"role": "user", "content": "what is 1+1?"}]


@lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    from moe_serve.service.embedded_model import ensure_embedded_model

    return AutoTokenizer.from_pretrained(str(ensure_embedded_model()))


# --- completions: tests/entrypoints/openai/completion/test_completion.py ---

def test_single_completion(client: openai.OpenAI, model: str) -> None:  # test_single_completion
    no_eos = {"ignore_eos": True}
    completion = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=5, temperature=0.0,
                                           extra_body=no_eos)
    choice = completion.choices[0]
    assert completion.id and len(completion.choices) == 1
    assert isinstance(choice.text, str) and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == len(_tokenizer().encode("Hello, my name is"))
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    by_ids = client.completions.create(model=model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                       extra_body=no_eos)
    assert by_ids.usage.prompt_tokens == 5 and by_ids.usage.completion_tokens == 5
    assert getattr(by_ids.choices[0], "prompt_logprobs", None) is None


def test_completion_truncation_side_controls_prompt_truncation(client: openai.OpenAI, model: str) -> None:
    ids = list(range(1, 9))  # test_completion_truncation_side_controls_prompt_truncation
    for side, expected in (("right", ids[:4]), ("left", ids[-4:])):
        out = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0.0, extra_body={
            "return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side})
        assert out.choices[0].prompt_token_ids == expected


def test_no_logprobs(client: openai.OpenAI, model: str) -> None:  # test_no_logprobs
    out = client.completions.create(model=model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0, logprobs=None)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])  # test_zero_logprobs, test_some_logprobs
def test_zero_and_some_logprobs(client: openai.OpenAI, model: str, k: int) -> None:
    out = client.completions.create(model=model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0, logprobs=k,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert max(k, 1) <= len(lp.top_logprobs[0]) <= k + 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5


def test_too_many_completion_logprobs(client: openai.OpenAI, model: str) -> None:  # test_too_many_completion_logprobs
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        for _ in client.completions.create(model=model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                           logprobs=30, stream=True):
            pass
    assert client.completions.create(model=model, prompt=[0, 0, 0, 0, 0], max_tokens=5).choices


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])  # test_prompt_logprobs_completion
def test_prompt_logprobs_completion(client: openai.OpenAI, model: str, prompt_logprobs: int | None) -> None:
    params: dict = {"model": model, "prompt": ["A robot may not injure another robot", "My name is"], "max_tokens": 4}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**params)
        return
    out = client.completions.create(**params)
    if prompt_logprobs is None:
        assert out.choices[0].prompt_logprobs is None
    else:
        assert len(out.choices[0].prompt_logprobs) > 0 and len(out.choices[1].prompt_logprobs) > 0


def test_completion_streaming(client: openai.OpenAI, model: str) -> None:  # test_completion_streaming
    kwargs = dict(model=model, prompt="What is an LLM?", max_tokens=5, temperature=0.0,
                  extra_body={"ignore_eos": True})
    single = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert sum(1 for c in chunks if c.choices[0].finish_reason is not None) == 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == single


def test_parallel_no_streaming(client: openai.OpenAI, model: str) -> None:  # test_parallel_no_streaming
    out = client.completions.create(model=model, prompt="What is an LLM?", max_tokens=50, n=3, temperature=1.0,
                                    logprobs=0, seed=42)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason is not None for c in out.choices)
    assert len({c.text for c in out.choices}) == 3
    assert all(len(c.logprobs.tokens) <= 50 for c in out.choices)


def test_parallel_streaming(client: openai.OpenAI, model: str) -> None:  # test_parallel_streaming
    chunks: list[list[str]] = [[] for _ in range(3)]
    finished = 0
    for chunk in client.completions.create(model=model, prompt="What is an LLM?", max_tokens=50, n=3,
                                           temperature=1.0, stream=True, seed=42):
        chunks[chunk.choices[0].index].append(chunk.choices[0].text)
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 3
    assert all(len(c) <= 50 for c in chunks)
    assert len({"".join(c) for c in chunks}) == 3


def test_completion_stream_options(client: openai.OpenAI, model: str) -> None:  # test_completion_stream_options
    kwargs = dict(model=model, prompt="What is the capital of France?", max_tokens=5, temperature=0.0)
    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(c.usage is None for c in client.completions.create(stream=True, stream_options=options, **kwargs))
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    chunks = list(client.completions.create(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **kwargs))
    assert all(c.usage is not None and c.usage.completion_tokens > 0 for c in chunks)
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(stream=False, stream_options=options, **kwargs)


def test_batch_completions(client: openai.OpenAI, model: str) -> None:  # test_batch_completions
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0.0)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        beams = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=5, temperature=0.0,
                                          extra_body={"use_beam_search": True})
        texts = [c.text for c in beams.choices]
        assert len(texts) == 4 and texts[0] != texts[1] and texts[0] == texts[2] and texts[1] == texts[3]
        streamed = ["", ""]
        for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0.0,
                                               stream=True):
            assert len(chunk.choices) == 1
            streamed[chunk.choices[0].index] += chunk.choices[0].text
        assert streamed[0] == streamed[1]


@pytest.mark.parametrize("logprobs_arg", [1, 0])  # test_echo_logprob_completion
def test_echo_logprob_completion(client: openai.OpenAI, model: str, logprobs_arg: int) -> None:
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                                        logprobs=logprobs_arg)
        text = _tokenizer().decode(prompt) if isinstance(prompt, list) else prompt
        assert out.choices[0].text.startswith(text)
        lp = out.choices[0].logprobs
        assert len(lp.text_offset) > 5 and len(lp.tokens) > 5
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1 for top in lp.top_logprobs[1:])


@pytest.mark.parametrize("structured", [  # test_invalid_json_schema, test_invalid_regex, test_invalid_grammar
    {"json": {"type": "object", "properties": {"brand": {"type": "string"}, "foo": "bar"}}},
    {"regex": r"[.*"},
    {"grammar": 'root ::= select_statementinvalidsyntax\nselect_statement ::= "SELECT " column'},
], ids=["json", "regex", "grammar"])
def test_invalid_structured_outputs(client: openai.OpenAI, model: str, structured: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="Generate", max_tokens=8, extra_body={
            "structured_outputs": structured})


# --- chat: tests/entrypoints/openai/chat_completion/test_chat.py ---

def test_no_logprobs_chat(client: openai.OpenAI, model: str) -> None:  # test_no_logprobs_chat
    out = client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=5,
                                         temperature=0.0, logprobs=False)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])  # test_zero_logprobs_chat, test_some_logprobs_chat
def test_zero_and_some_logprobs_chat(client: openai.OpenAI, model: str, k: int) -> None:
    out = client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=5,
                                         temperature=0.0, logprobs=True, top_logprobs=k,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == k for t in content)


def test_too_many_chat_logprobs(client: openai.OpenAI, model: str) -> None:  # test_too_many_chat_logprobs
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10,
                                                logprobs=True, top_logprobs=21, stream=True):
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10,
                                       logprobs=True, top_logprobs=30)
    assert client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10).choices


HISTORY = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "Who won the world series in 2020?"},
           {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
           {"role": "user", "content": "Where was it played?"}]


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])  # test_prompt_logprobs_chat
def test_prompt_logprobs_chat(client: openai.OpenAI, model: str, prompt_logprobs: int | None) -> None:
    params: dict = {"model": model, "messages": HISTORY, "max_completion_tokens": 4}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**params)
        return
    out = client.chat.completions.create(**params)
    got = getattr(out, "prompt_logprobs", None)
    assert (got is None) if prompt_logprobs is None else len(got) > 0


def test_more_than_one_prompt_logprobs_chat(client: openai.OpenAI, model: str) -> None:
    # test_more_than_one_prompt_logprobs_chat
    params = {"model": model, "messages": HISTORY, "max_completion_tokens": 4}
    one = client.chat.completions.create(**params, extra_body={"prompt_logprobs": 1})
    two = client.chat.completions.create(**params, extra_body={"prompt_logprobs": 2})
    # a position's entry holds the prompt token itself plus the top k (one entry when they coincide)
    assert 1 <= len(one.prompt_logprobs[3]) <= 2 and 2 <= len(two.prompt_logprobs[3]) <= 3
    assert len(two.prompt_logprobs[3]) > len(one.prompt_logprobs[3]) or len(one.prompt_logprobs[3]) == 2


def test_single_chat_session(client: openai.OpenAI, model: str) -> None:  # test_single_chat_session
    messages = list(ONE_PLUS_ONE)
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=5, logprobs=True,
                                         top_logprobs=5, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.id and len(out.choices) == 1 and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    messages += [{"role": "assistant", "content": choice.message.content},
                 {"role": "user", "content": "express your result in json"}]
    assert client.chat.completions.create(model=model, messages=messages, max_completion_tokens=5).choices


def test_chat_streaming(client: openai.OpenAI, model: str) -> None:  # test_chat_streaming
    kwargs = dict(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10, temperature=0.0)
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    assert sum(1 for c in chunks if c.choices[0].finish_reason is not None) == 1
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content


def test_chat_completion_stream_options(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]  # test_chat_completion_stream_options
    kwargs = dict(model=model, messages=messages, max_completion_tokens=10, temperature=0.0)
    assert all(c.usage is None for c in client.chat.completions.create(
        stream=True, stream_options={"include_usage": False}, **kwargs))
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == [] and chunks[-1].usage
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(stream=False, stream_options=options, **kwargs)
    last = 0
    for chunk in client.chat.completions.create(stream=True, extra_body={"min_tokens": 10}, stream_options={
            "include_usage": True, "continuous_usage_stats": True}, **kwargs):
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        assert chunk.usage.completion_tokens >= last
        last = chunk.usage.completion_tokens
    assert last == 10


def test_structured_outputs_choice_chat(client: openai.OpenAI, model: str) -> None:  # same name upstream
    messages = [SYSTEM, {"role": "user", "content": "The best language for type-safe systems programming is "}]
    for _ in range(2):
        out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10,
                                             temperature=0.7, extra_body={"structured_outputs": {"choice": CHOICES}})
        choice = out.choices[0].message.content
        assert choice in CHOICES
        messages = messages + [{"role": "assistant", "content": choice},
                               {"role": "user", "content": "I disagree, pick another one"}]


def test_structured_outputs_json_chat(client: openai.OpenAI, model: str) -> None:  # test_structured_outputs_json_chat
    messages = [SYSTEM, {"role": "user", "content": f"Give an example JSON for an employee: {EMPLOYEE_SCHEMA}"}]
    for _ in range(2):
        out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=200,
                                             temperature=0.0,
                                             extra_body={"structured_outputs": {"json": EMPLOYEE_SCHEMA}})
        content = out.choices[0].message.content
        jsonschema.validate(instance=json.loads(content), schema=EMPLOYEE_SCHEMA)
        messages = messages + [{"role": "assistant", "content": content},
                               {"role": "user", "content": "Give me another one with a different name and age"}]


def test_structured_outputs_regex_chat(client: openai.OpenAI, model: str) -> None:  # test_structured_outputs_regex_chat
    messages = [SYSTEM, {"role": "user", "content": f"Give an example IP address with this regex: {IP_REGEX}"}]
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=20,
                                         extra_body={"structured_outputs": {"regex": IP_REGEX}})
    assert re.fullmatch(IP_REGEX, out.choices[0].message.content)


def test_structured_outputs_type_error(client: openai.OpenAI, model: str) -> None:  # test_structured_outputs_type_error
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, extra_body={
            "structured_outputs": {"regex": {1: "Python", 2: "C++"}}})


def test_structured_outputs_choice_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(  # test_structured_outputs_choice_chat_logprobs
        model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10, logprobs=True, top_logprobs=5,
        extra_body={"structured_outputs": {"choice": CHOICES}})
    top = out.choices[0].logprobs.content[0].top_logprobs
    assert top and all(item.logprob >= -9999.0 for item in top)


def test_response_format_json_object(client: openai.OpenAI, model: str) -> None:  # test_response_format_json_object
    out = client.chat.completions.create(model=model, temperature=0.0, max_completion_tokens=300, messages=[
        {"role": "user", "content": 'what is 1+1? please respond with a JSON object, the format is {"result": 2}'}],
        response_format={"type": "json_object"})
    choice = out.choices[0]
    # Any JSON object is allowed, so a random model may still be inside a string when max tokens cut it.
    if choice.finish_reason == "length":
        assert choice.message.content.startswith("{")
    else:
        assert isinstance(json.loads(choice.message.content), dict)


def test_response_format_json_schema(client: openai.OpenAI, model: str) -> None:  # test_response_format_json_schema
    schema = {"type": "object", "properties": {"result": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["result"], "additionalProperties": False}
    out = client.chat.completions.create(model=model, temperature=0.0, max_completion_tokens=50, messages=[
        {"role": "user", "content": 'what is 1+1? The format is "result": 2'}],
        response_format={"type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}})
    assert json.loads(out.choices[0].message.content)["result"] in (1, 2, 3)


def test_response_format_text(client: openai.OpenAI, model: str) -> None:  # test_response_format_text
    out = client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10,
                                         response_format={"type": "text"})
    assert out.choices[0].message.content is not None


def test_extra_fields_allowed(client: openai.OpenAI, model: str) -> None:  # test_extra_fields_allowed
    out = client.chat.completions.create(model=model, temperature=0, seed=0, max_completion_tokens=5, messages=[
        {"role": "user", "content": "what is 1+1?", "extra_field": "0"}])  # type: ignore[list-item]
    assert out.choices[0].message.content is not None


def test_complex_message_content(client: openai.OpenAI, model: str) -> None:  # test_complex_message_content
    text = "what is 1+1? please provide the result without any other text."
    parts = client.chat.completions.create(model=model, temperature=0, seed=0, max_completion_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": text}]}])
    plain = client.chat.completions.create(model=model, temperature=0, seed=0, max_completion_tokens=8,
                                           messages=[{"role": "user", "content": text}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_custom_role(client: openai.OpenAI, model: str) -> None:  # test_custom_role
    kwargs = dict(model=model, temperature=0, seed=0, max_completion_tokens=8)
    one = client.chat.completions.create(messages=[{"role": "my-custom-role", "content": "what is 1+1?"}], **kwargs)
    two = client.chat.completions.create(messages=[{"role": "my-custom-role", "content": [
        {"type": "text", "text": "what is 1+1?"}]}], **kwargs)
    assert one.choices[0].message.content == two.choices[0].message.content


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])  # test_long_seed
def test_long_seed(client: openai.OpenAI, model: str, seed: int, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, temperature=0, seed=seed, messages=[SYSTEM])
    assert "greater than or equal" in exc.value.message or "less than or equal" in exc.value.message
    assert http.get("/health").json()["unfinished_requests"] == 0  # nothing leaked into the engine


def test_chat_completion_n_parameter_non_streaming(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(  # test_chat_completion_n_parameter_non_streaming
        model=model, messages=[{"role": "user", "content": "What is the opposite of big?"}],
        max_completion_tokens=20, temperature=0.7, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.message.content for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1


def test_chat_completion_n_parameter_streaming(client: openai.OpenAI, model: str) -> None:
    by_index: dict[int, list[str]] = defaultdict(list)  # test_chat_completion_n_parameter_streaming
    for chunk in client.chat.completions.create(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=15,
                                                temperature=0.7, n=2, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                by_index[choice.index].append(choice.delta.content)
    assert by_index[0] and by_index[1]


def test_chat_completion_n_with_seed(client: openai.OpenAI, model: str) -> None:  # test_chat_completion_n_with_seed
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=10,
                  temperature=0.8, n=2, seed=42)
    one, two = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in one.choices] == [0, 1]
    assert [c.message.content for c in one.choices] == [c.message.content for c in two.choices]


# --- tools: tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py ---

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Vienna", "Berlin"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "Hi! How are you doing today?"},
               {"role": "assistant", "content": "I'm doing well! How can I help you?"},
               {"role": "user", "content": "What is the weather in Berlin, in fahrenheit?"}]
NAMED = {"type": "function", "function": {"name": "get_current_weather"}}


def _calls_by_index(deltas: list) -> dict[int, dict[str, str]]:
    """Streamed tool-call deltas joined per call index: {index: {"id", "name", "arguments"}}."""
    calls: dict[int, dict[str, str]] = defaultdict(lambda: {"id": "", "name": "", "arguments": ""})
    for d in deltas:
        call = calls[d.index]
        call["id"] = call["id"] or (d.id or "")
        call["name"] += (d.function.name or "") if d.function else ""
        call["arguments"] += (d.function.arguments or "") if d.function else ""
    return dict(calls)


@pytest.mark.parametrize("stream", [True, False])  # test_function_tool_use ("auto" needs a trained model)
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_function_tool_use(client: openai.OpenAI, model: str, stream: bool, tool_choice) -> None:
    # "required" lets the model emit any number of calls (~65 tokens each), every one checked by its
    # index. Sampled, not greedy: a greedy random-weight model may repeat the same call until the
    # budget on some CPU kind; sampled, it closes the array after each call by chance, far inside 2000.
    kwargs = dict(model=model, messages=WEATHER_ASK, tools=[WEATHER_TOOL], tool_choice=tool_choice,
                  max_completion_tokens=2000)
    schema = WEATHER_TOOL["function"]["parameters"]
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason != "length", choice
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    else:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] != ["length"]
        by_index = _calls_by_index([d for c in chunks for d in (c.choices[0].delta.tool_calls or [])])
        assert sorted(by_index) == list(range(len(by_index)))  # indexes 0..n-1, none skipped
        calls = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(by_index.items())]
    assert calls and (len(calls) == 1 or tool_choice == "required")
    for call_id, name, arguments in calls:
        assert call_id and name == "get_current_weather"
        jsonschema.validate(json.loads(arguments), schema)


def test_named_tool_use(client: openai.OpenAI, model: str) -> None:  # test_named_tool_use
    tool = {"type": "function", "function": {"name": "dummy_function_name", "description": "This is a dummy function",
                                             "parameters": EMPLOYEE_SCHEMA, "strict": True}}
    choice = {"type": "function", "function": {"name": "dummy_function_name"}}
    messages = [SYSTEM, {"role": "user", "content": "Give an example JSON for an employee profile."}]
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=300, tools=[tool],
                                         temperature=0.0, tool_choice=choice)
    message = out.choices[0].message
    assert not message.content
    arguments = message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), EMPLOYEE_SCHEMA)
    messages += [{"role": "assistant", "content": arguments},
                 {"role": "user", "content": "Give me another one with a different name and age"}]
    parts, finished = [], 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_completion_tokens=300,
                                                tools=[tool], tool_choice=choice, temperature=0.0, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        if delta.tool_calls and delta.tool_calls[0].function.arguments:
            parts.append(delta.tool_calls[0].function.arguments)
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 1
    jsonschema.validate(json.loads("".join(parts)), EMPLOYEE_SCHEMA)


def test_inconsistent_tool_choice_and_tools(client: openai.OpenAI, model: str) -> None:
    tool = {"type": "function", "function": {"name": "dummy_function_name", "parameters": EMPLOYEE_SCHEMA}}
    # test_inconsistent_tool_choice_and_tools
    kwargs = dict(model=model, messages=ONE_PLUS_ONE, max_completion_tokens=10)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "dummy_function_name"}},
                                       **kwargs)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(tools=[tool], tool_choice={"type": "function", "function": {
            "name": "nondefined_function_name"}}, **kwargs)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(tools=[tool], tool_choice={}, **kwargs)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_max_tokens_with_tool_choice_required(client: openai.OpenAI, model: str, tool_choice) -> None:
    out = client.chat.completions.create(  # test_max_tokens_with_tool_choice_required
        model=model, messages=WEATHER_ASK, temperature=0, max_completion_tokens=1, tools=[WEATHER_TOOL],
        tool_choice=tool_choice)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    if tool_choice == "required":
        assert choice.message.tool_calls is None
    else:  # vLLM's JSON-schema path (VLLM_ENFORCE_STRICT_TOOL_CALLING=0, see service/engine.py) returns
        # the named call with its cut-off arguments; with structural tags (the original) it returns none
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_current_weather"
        with pytest.raises(json.JSONDecodeError):
            json.loads(call.function.arguments)


# --- tokenization: tests/entrypoints/serve/tokenize/test_tokenization.py ---

def test_tokenize_completions(http: httpx.Client, model: str) -> None:  # test_tokenize_completions
    prompt = "vllm1 This is a test prompt."
    for add_special in (False, True):
        body = http.post("/tokenize", json={"add_special_tokens": add_special, "model": model, "prompt": prompt}).json()
        tokens = _tokenizer().encode(prompt, add_special_tokens=add_special)
        assert body == {"tokens": tokens, "count": len(tokens), "max_model_len": 4096, "token_strs": None}


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["plain", "with_tools"])
def test_tokenize_chat(http: httpx.Client, model: str, tools) -> None:  # test_tokenize_chat, ..._with_tools
    conversation = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"},
                    {"role": "user", "content": "Can I ask a question? vllm1"}]
    for add_special in (False, True):
        for continue_final in (False, True):
            messages = conversation + ([{"role": "assistant", "content": "Sure,"}] if continue_final else [])
            text = _tokenizer().apply_chat_template(messages, tools=tools, tokenize=False,
                                                    continue_final_message=continue_final)
            tokens = _tokenizer().encode(text, add_special_tokens=add_special)
            body = {"continue_final_message": continue_final, "add_generation_prompt": not continue_final,
                    "add_special_tokens": add_special, "messages": messages, "model": model}
            if tools:
                body["tools"] = tools
            result = http.post("/tokenize", json=body).json()
            assert result["tokens"] == tokens and result["count"] == len(tokens)


def test_tokenize_with_return_token_strs(http: httpx.Client, model: str) -> None:  # same name upstream
    prompt = "This is a token_strs test prompt! vllm1"
    result = http.post("/tokenize", json={"prompt": prompt, "model": model, "return_token_strs": True}).json()
    tokens = _tokenizer().encode(prompt, add_special_tokens=True)
    assert result["tokens"] == tokens and result["token_strs"] == _tokenizer().convert_ids_to_tokens(tokens)


def test_detokenize(http: httpx.Client, model: str) -> None:  # test_detokenize
    prompt = "This is a test prompt. vllm1"
    tokens = _tokenizer().encode(prompt, add_special_tokens=False)
    assert http.post("/detokenize", json={"model": model, "tokens": tokens}).json() == {"prompt": prompt}
