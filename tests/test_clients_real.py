"""Real client libraries against the real server: openai SDK `parse`, LangChain, LiteLLM, lm-eval.

A random-weight model writes meaningless text, so every structured request uses a schema with
finitely many values: the engine's structured-output grammar then makes any completion valid.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from moe_serve.loadtest.server_proc import ServerProcess
from tests.conftest import API_KEY

pytestmark = pytest.mark.engine


class Pet(BaseModel):
    """A schema with 2 x 2 x 3 possible values."""

    species: Literal["cat", "dog"]
    legs: Literal[2, 4]
    mood: Literal["calm", "playful", "sleepy"]


def test_openai_parse_returns_the_pydantic_model(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe a pet."}],
                                        response_format=Pet, max_completion_tokens=80, temperature=0.0)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Pet)
    assert Pet.model_validate_json(message.content) == message.parsed


def test_openai_parse_with_a_strict_function_tool(client: openai.OpenAI, model: str) -> None:
    tool = openai.pydantic_function_tool(Pet, name="record_pet")
    out = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Record a pet."}],
                                        tools=[tool], max_completion_tokens=120, temperature=0.0,
                                        tool_choice={"type": "function", "function": {"name": "record_pet"}})
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "record_pet" and call.id
    assert isinstance(call.function.parsed_arguments, Pet)


def _chat_model(server: ServerProcess, model: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=server.base_url + "/v1", api_key=API_KEY, temperature=0.0,
                      max_tokens=120, max_retries=0, timeout=60)


def test_langchain_with_structured_output(server: ServerProcess, model: str) -> None:
    result = _chat_model(server, model).with_structured_output(Pet).invoke("Describe a pet.")
    assert isinstance(result, Pet)


def test_langchain_bind_tools_with_a_named_tool(server: ServerProcess, model: str) -> None:
    bound = _chat_model(server, model).bind_tools([Pet], tool_choice="Pet", strict=True)
    message = bound.invoke("Record a pet.")
    assert [c["name"] for c in message.tool_calls] == ["Pet"]
    Pet.model_validate(message.tool_calls[0]["args"])
    streamed = None
    for chunk in bound.stream("Record a pet."):  # tool-call deltas, merged by LangChain
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["Pet"]
    Pet.model_validate(streamed.tool_calls[0]["args"])


def test_litellm_completion_stream_and_tool_call(server: ServerProcess, model: str) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map
    import litellm

    common = dict(model=f"hosted_vllm/{model}", api_base=server.base_url + "/v1", api_key=API_KEY, timeout=60)
    messages = [{"role": "user", "content": "Hi"}]
    out = litellm.completion(messages=messages, max_tokens=6, temperature=0.0, **common)
    assert 1 <= out.usage.completion_tokens <= 6  # the text itself may be empty (greedy EOS on some CPUs)
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(
        messages=messages, max_tokens=6, temperature=0.0, stream=True, **common))
    assert text == (out.choices[0].message.content or "")
    tool = openai.pydantic_function_tool(Pet, name="record_pet")
    called = litellm.completion(messages=messages, tools=[tool], max_tokens=120, temperature=0.0,
                                tool_choice={"type": "function", "function": {"name": "record_pet"}}, **common)
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "record_pet"
    Pet.model_validate_json(call.function.arguments)


DOCS = [{"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},  # lm-eval joins with " "
        {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
        {"question": "Cats say", "choices": ["meow", "moo", "quack", "bark"], "answer": 1}]


def _write_task(root: Path) -> Path:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "tiny_mc.yaml").write_text(
        "task: moe_serve_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    return root


def test_lm_eval_local_completions_loglikelihood(server: ServerProcess, model: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, http: httpx.Client) -> None:
    """lm-eval's multiple-choice path: echo + logprobs on prompt+continuation, tokenized by lm-eval."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from moe_serve.service.embedded_model import ensure_embedded_model

    tokenizer = ensure_embedded_model()
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["moe_serve_tiny_mc"], log_samples=True,
        task_manager=TaskManager(include_path=str(_write_task(tmp_path))),
        model_args=f"model={model},base_url={server.base_url}/v1/completions,tokenizer={tokenizer},"
                   "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    acc = results["results"]["moe_serve_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["moe_serve_tiny_mc"]
    assert len(samples) == len(DOCS)
    # lm-eval's log-likelihood of the first doc's first choice equals the sum of the server's
    # token logprobs of that continuation, asked for directly.
    first = next(s for s in samples if s["doc"]["question"] == DOCS[0]["question"])
    lm_eval_ll = first["resps"][0][0][0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    context = tok(DOCS[0]["question"], add_special_tokens=False).input_ids  # as lm-eval encodes (no BOS)
    whole = tok(DOCS[0]["question"] + " " + DOCS[0]["choices"][0], add_special_tokens=False).input_ids
    body = http.post("/v1/completions", json={"model": model, "prompt": whole, "max_tokens": 1, "echo": True,
                                              "logprobs": 1, "temperature": 0}).json()
    direct = sum(body["choices"][0]["logprobs"]["token_logprobs"][len(context):len(whole)])
    assert math.isclose(lm_eval_ll, direct, rel_tol=1e-4, abs_tol=1e-4)
