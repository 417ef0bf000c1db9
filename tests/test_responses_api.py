"""The OpenAI Responses API (`POST /v1/responses`, vLLM's own handler) and `vllm serve`'s /load and
POST /ping, with the real `openai` client against the session server (auth on). The random-weight
model's text is never asserted: structure, usage, finite schemas and vLLM's error wording are."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from tests.monitoring_helpers import delta, scrape

pytestmark = pytest.mark.engine
PET = {"type": "object", "properties": {"species": {"enum": ["cat", "dog"]}, "legs": {"enum": [2, 4]}},
       "required": ["species", "legs"], "additionalProperties": False}
PET_FORMAT = {"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}}
RECORD_PET = {"type": "function", "name": "record_pet", "parameters": PET, "strict": True}


def test_response_is_vllms_response_object_and_counted_in_the_metrics(server, client: openai.OpenAI,
                                                                      model: str) -> None:
    before = scrape(server.base_url, server.headers)
    out = client.responses.create(model=model, instructions="Answer briefly.",
                                  input=[{"role": "user", "content": "Describe a pet."}], max_output_tokens=40,
                                  text=PET_FORMAT)
    after = scrape(server.base_url, server.headers)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == model
    assert out.status == "completed" and out.instructions == "Answer briefly."
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    jsonschema.validate(json.loads(out.output_text), PET)
    usage = out.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 40
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert delta(before, after, "moe_serve_requests_total", status="ok") == 1
    assert delta(before, after, "moe_serve_prompt_tokens_total") == usage.input_tokens
    assert delta(before, after, "moe_serve_generation_tokens_total") == usage.output_tokens


def test_streamed_response_events_end_with_the_completed_response(client: openai.OpenAI, model: str) -> None:
    events = list(client.responses.create(model=model, input="Hello", max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status in ("completed", "incomplete") and 0 < final.usage.output_tokens <= 6
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text


def test_required_tool_calls_are_function_call_items(client: openai.OpenAI, model: str) -> None:
    # the random model closes vLLM's array of calls after each item by chance (~40 tokens an item;
    # 40 samples ran 33-267 tokens, and a CI run once passed 400): a budget that cuts the array
    # leaves no call to parse, so it sits far beyond where the random model stops
    out = client.responses.create(model=model, input="Record a pet.", tools=[RECORD_PET], tool_choice="required",
                                  max_output_tokens=2000)
    assert out.status == "completed", out.status
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and len(calls) == len(out.output)
    for call in calls:
        assert call.name == "record_pet" and call.call_id
        jsonschema.validate(json.loads(call.arguments), PET)


def test_responses_errors_keep_vllms_wording(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
        client.responses.create(model=model, input="x", background=True, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError, match="resp_unknown"):
        client.responses.create(model=model, input="x", previous_response_id="resp_unknown", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="empty conversation"):
        client.responses.create(model=model, input=[], max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="another-model", input="x", max_output_tokens=4)


def test_built_in_tools_without_a_tool_server_are_a_400_naming_them(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=model, input="search", max_output_tokens=4,
                                tools=[RECORD_PET, {"type": "web_search_preview"}])
    error = exc.value.body
    assert error["param"] == "tools.1.type" and "web_search_preview" in error["message"], error
    with pytest.raises(openai.BadRequestError, match="unknown field 'x_unknown'"):
        client.responses.create(model=model, input="x", max_output_tokens=4, extra_body={"x_unknown": 1})


def test_assistant_input_messages_need_an_output_text_part(http: httpx.Client, model: str) -> None:
    """vLLM reads an assistant input message's first content part as text (a 500 in `vllm serve`
    for none, or a refusal first): here a 400 naming the part."""
    item = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": []}
    r = http.post("/v1/responses", json={"model": model, "input": [item], "max_output_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content", r.text
    refusal = {**item, "content": [{"type": "refusal", "refusal": "no"}]}
    r = http.post("/v1/responses", json={"model": model, "input": [{"role": "user", "content": "hi"}, refusal],
                                         "max_output_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.content.0.type", r.text
    text = {**item, "content": [{"type": "output_text", "text": "earlier answer", "annotations": []}]}
    r = http.post("/v1/responses", json={"model": model, "input": [text, {"role": "user", "content": "and?"}],
                                         "max_output_tokens": 4})
    assert r.status_code == 200, r.text


def test_load_counts_running_sequences_and_ping_takes_post(server, http: httpx.Client, model: str) -> None:
    assert httpx.post(server.base_url + "/ping").status_code == 200  # public, as GET /ping
    assert httpx.get(server.base_url + "/load").status_code == 401  # behind the key like every other route
    started = threading.Event()
    loads: list[int] = []

    def stream() -> None:
        with http.stream("POST", "/v1/responses", json={"model": model, "input": "Go on", "stream": True,
                                                         "max_output_tokens": 400}) as resp:
            for line in resp.iter_lines():
                if line.startswith("event: response.output_text.delta") and not started.is_set():
                    loads.append(http.get("/load").json()["server_load"])
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    thread.join(120)
    assert started.is_set() and loads == [1], loads
    # the slot is released once the response has been sent (as vLLM's load counter, a background
    # task after the body): the client can read the last event a moment before
    deadline = time.monotonic() + 10
    while (load := http.get("/load").json()) != {"server_load": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load == {"server_load": 0}, load


def test_a_response_is_not_stored_without_vllms_store(http: httpx.Client, model: str) -> None:
    """As `vllm serve` without VLLM_ENABLE_RESPONSES_API_STORE: retrieve and cancel answer vLLM's 404."""
    created = http.post("/v1/responses", json={"model": model, "input": "Hi", "max_output_tokens": 4}).json()
    for method, path in (("GET", f"/v1/responses/{created['id']}"), ("POST", f"/v1/responses/{created['id']}/cancel")):
        resp = http.request(method, path)
        assert resp.status_code == 404, resp.text
        err = resp.json()["error"]
        assert err["param"] == "response_id" and f"'{created['id']}' not found" in err["message"]


def test_a_stored_response_is_retrieved_and_a_finished_one_cannot_be_cancelled(strict_server) -> None:
    """With vLLM's store on (the strict server): GET returns the response as created; cancelling
    a finished one is vLLM's 400; an unknown id is its 404."""
    with httpx.Client(base_url=strict_server.base_url, headers=strict_server.headers, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        created = http.post("/v1/responses", json={"model": model, "input": "Hi", "max_output_tokens": 4}).json()
        got = http.get(f"/v1/responses/{created['id']}")
        assert got.status_code == 200 and got.json()["id"] == created["id"]
        assert got.json()["output"] == created["output"] and got.json()["status"] == created["status"]
        cancel = http.post(f"/v1/responses/{created['id']}/cancel")
        assert cancel.status_code == 400 and "Cannot cancel a synchronous response" in cancel.json()["error"]["message"]
        assert http.get("/v1/responses/resp_unknown").status_code == 404
        assert http.get(f"/v1/responses/{created['id']}", params={"starting_after": "x"}).status_code == 400
