"""The real `openai` client against the real server (vLLM CPU engine, embedded model).

The random-weight model's greedy text differs between CPU kinds: tests compare two answers of the
same server, count tokens with `ignore_eos`, and never assert what the text says or that it is
non-empty (where text is needed, `allowed_token_ids` restricts it to plain words).
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.engine


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [model]


def test_completion_stream_joins_to_non_stream_at_temperature_zero(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_chat_stream_joins_to_non_stream_and_usage_adds_up(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    kwargs = dict(model=model, messages=messages, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens == 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_max_completion_tokens_is_honoured(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                         max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"


# the embedded model's ids of "▁apple", "▁river", "▁stone", "▁cloud", "▁green", "▁house"
WORD_TOKENS = [19767, 7782, 7253, 6945, 5344, 2134]


def test_stop_string_ends_generation_before_it(client: openai.OpenAI, model: str) -> None:
    words_only = {"allowed_token_ids": WORD_TOKENS}  # 24 tokens of >= 6 characters each, whatever the CPU
    base = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.0,
                                     extra_body=words_only).choices[0].text
    assert len(base) >= 24 * 6
    stop = base[len(base) // 2: len(base) // 2 + 3]
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.0,
                                    stop=[stop], extra_body=words_only)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.index(stop)]


def test_n_greater_than_one_returns_n_choices(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Numbers:", max_tokens=5, n=3, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    chunks = list(client.completions.create(model=model, prompt="Numbers:", max_tokens=5, n=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    finishing = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishing == [0, 1, 2]  # exactly one finishing chunk per choice


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="Random:", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_batch_prompts_and_token_id_prompts(client: openai.OpenAI, model: str) -> None:
    texts = client.completions.create(model=model, prompt=["a b c", "d e f"], max_tokens=4, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in texts.choices) == [0, 1]
    assert texts.usage.completion_tokens == 8
    # Each choice answers its own prompt (a batch of 2 and a batch of 1 may round differently on some
    # CPUs, so the prompts are compared, not the greedy texts).
    ids = client.completions.create(model=model, prompt=[[1, 415, 2936], [1, 264]], max_tokens=4, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    by_index = {c.index: c.prompt_token_ids for c in ids.choices}
    assert by_index == {0: [1, 415, 2936], 1: [1, 264]}
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 8


def test_echo_prepends_the_prompt(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Echo this", max_tokens=3, echo=True, temperature=0.0)
    assert out.choices[0].text.startswith("Echo this")
