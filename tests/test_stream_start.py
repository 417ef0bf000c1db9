"""When a streamed response starts: once the engine has accepted the request, not at its first token.

`moe_serve.service.request_flow.serve` driven as the route drives it, with real vLLM types (SamplingParams,
RequestOutput, VLLMValidationError), our real engine client, admission and metrics, and a stand-in
AsyncLLM whose `generate` calls its `add_request` and then holds the first output until the test
lets it go. The response is run as an ASGI app and every message it sends is recorded, so the test
sees the order of headers and tokens without timing anything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils.async_utils import merge_async_iterators

from moe_serve.service.admission import Admission
from moe_serve.service.engine_client import ObservedEngineClient, report_acceptance
from moe_serve.service.errors import APIError
from moe_serve.service.metrics import ServiceMetrics
from moe_serve.service.request_flow import serve
from moe_serve.service.streaming import DONE_EVENT

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
         "root_path": "", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


class _StandInEngine:
    """AsyncLLM's shape as `generate` uses it: `add_request` first, then outputs as they come."""

    errored = False

    def __init__(self, reject: BaseException | None = None, add_hangs: bool = False, prompts: int = 1) -> None:
        self.reject, self.add_hangs = reject, add_hangs
        self.accepted: list[str] = []
        self.first_token = asyncio.Event()  # the test opens it: the engine's first output exists
        self.closed: list[str] = []         # engine requests whose generate() ended (finished or aborted)
        self.prompts = prompts

    async def add_request(self, request_id: str, prompt, params, **_) -> str:
        if self.add_hangs:
            await asyncio.Event().wait()
        if self.reject is not None:
            raise self.reject
        self.accepted.append(request_id)
        return request_id

    async def generate(self, prompt, params, request_id, **_) -> AsyncIterator[RequestOutput]:
        try:
            await self.add_request(request_id, prompt, params)
            await self.first_token.wait()
            for i, finish in ((0, None), (1, "length")):
                out = CompletionOutput(index=0, text=f"t{i}", token_ids=[10 + i], cumulative_logprob=None,
                                       logprobs=None, finish_reason=finish)
                yield RequestOutput(request_id, None, [1, 2, 3], None, [out], finish is not None)
        finally:
            self.closed.append(request_id)


class _Client:
    """One HTTP request's ASGI side: `receive` reports a disconnect once `disconnect` is set."""

    def __init__(self) -> None:
        self.disconnect = asyncio.Event()
        self.sent: list[dict] = []
        self.started = asyncio.Event()

    async def receive(self) -> dict:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.start":
            self.started.set()

    def events(self) -> list[str]:
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body").decode()
        return [chunk[len("data: "):] for chunk in body.split("\n\n") if chunk]


def _state(timeout_s: float | None) -> SimpleNamespace:
    metrics = ServiceMetrics(CollectorRegistry(), "m", reexport_default_registry=False)
    return SimpleNamespace(metrics=metrics, warmup_metrics=metrics, admission=Admission(4, 4, None),
                           settings=SimpleNamespace(request_timeout_s=timeout_s))


def _handler(engine: _StandInEngine, first_event: str | None = None):
    """A streaming handler as vLLM's completion handler is: one engine request per prompt, merged
    (all started at the stream's first step); returns its SSE events."""
    handle = SimpleNamespace(engine=engine, active=set(), note_engine_failure=lambda exc: False)
    report_acceptance(engine)
    client = ObservedEngineClient(handle)

    async def call() -> AsyncIterator[str]:
        streams = [client.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(output_kind=RequestOutputKind.DELTA),
                                   f"cmpl-{i}") for i in range(engine.prompts)]

        async def events() -> AsyncIterator[str]:
            if first_event is not None:
                yield first_event
            if streams:
                async for _, out in merge_async_iterators(*streams):
                    yield f"data: {json.dumps({'text': out.outputs[0].text})}\n\n"
            yield DONE_EVENT

        return events()

    return call, handle


async def _serve(client: _Client, state: SimpleNamespace, call) -> asyncio.Task:
    return asyncio.ensure_future(serve(Request(SCOPE, client.receive), state, 1, call))


def _status(state: SimpleNamespace) -> dict[str, float]:
    """moe_serve_requests_total by status label, the statuses counted at least once."""
    return {s.labels["status"]: s.value for metric in state.metrics.registry.collect()
            for s in metric.samples if s.name == "moe_serve_requests_total" and s.value}


def test_headers_go_out_once_accepted_and_the_first_token_follows_without_a_new_response() -> None:
    async def scenario() -> None:
        engine, client, state = _StandInEngine(prompts=2), _Client(), _state(60.0)
        call, handle = _handler(engine)
        response = await asyncio.wait_for(await _serve(client, state, call), 10)
        assert engine.accepted == ["cmpl-0", "cmpl-1"] and not engine.first_token.is_set()
        running = asyncio.ensure_future(response(SCOPE, client.receive, client.send))
        await asyncio.wait_for(client.started.wait(), 10)
        assert [m["type"] for m in client.sent] == ["http.response.start"] and client.sent[0]["status"] == 200
        assert state.admission.running == 1
        engine.first_token.set()
        await asyncio.wait_for(running, 10)
        assert sorted(json.loads(e)["text"] for e in client.events()[:-1]) == ["t0", "t0", "t1", "t1"]
        assert client.events()[-1] == "[DONE]"
        assert state.admission.running == 0 and handle.active == set() and sorted(engine.closed) == ["cmpl-0", "cmpl-1"]
        assert _status(state) == {"ok": 1.0}

    asyncio.run(scenario())


def test_a_request_the_engine_rejects_gets_its_status_not_a_started_stream() -> None:
    async def scenario() -> None:
        engine = _StandInEngine(reject=VLLMValidationError("prompt is too long", parameter="prompt"))
        client, state = _Client(), _state(60.0)
        call, _ = _handler(engine)
        with pytest.raises(APIError) as exc:
            await asyncio.wait_for(await _serve(client, state, call), 10)
        assert (exc.value.status, exc.value.param) == (400, "prompt")
        assert engine.closed == ["cmpl-0"] and state.admission.running == 0 and not client.sent

    asyncio.run(scenario())


def test_a_timeout_before_the_engine_accepted_is_a_408() -> None:
    async def scenario() -> None:
        engine, client, state = _StandInEngine(add_hangs=True), _Client(), _state(0.3)
        call, _ = _handler(engine)
        with pytest.raises(APIError) as exc:
            await asyncio.wait_for(await _serve(client, state, call), 10)
        assert exc.value.status == 408
        assert engine.closed == ["cmpl-0"] and state.admission.running == 0

    asyncio.run(scenario())


def test_a_timeout_after_the_start_ends_the_stream_with_an_error_event() -> None:
    async def scenario() -> None:
        engine, client, state = _StandInEngine(), _Client(), _state(0.3)
        call, _ = _handler(engine)
        response = await asyncio.wait_for(await _serve(client, state, call), 10)
        await asyncio.wait_for(response(SCOPE, client.receive, client.send), 10)  # the first token never comes
        assert client.sent[0]["status"] == 200
        events = client.events()
        assert json.loads(events[0])["error"]["code"] == "timeout" and events[1:] == ["[DONE]"]
        assert engine.closed == ["cmpl-0"] and state.admission.running == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("when", ["before the response runs", "after the headers"])
def test_a_client_gone_before_the_first_token_aborts_the_engine_request(when: str) -> None:
    async def scenario() -> None:
        engine, client, state = _StandInEngine(), _Client(), _state(60.0)
        call, handle = _handler(engine)
        response = await asyncio.wait_for(await _serve(client, state, call), 10)
        if when == "before the response runs":
            client.disconnect.set()
        running = asyncio.ensure_future(response(SCOPE, client.receive, client.send))
        if when == "after the headers":
            await asyncio.wait_for(client.started.wait(), 10)
            client.disconnect.set()
        await asyncio.wait_for(running, 10)
        assert engine.closed == ["cmpl-0"] and handle.active == set() and state.admission.running == 0
        assert not client.events()
        assert _status(state) == {"aborted": 1.0}

    asyncio.run(scenario())


def test_without_engine_requests_the_first_event_decides_the_status() -> None:
    """A handler whose stream begins no engine request up front (here: its first event is vLLM's
    error event) is answered at that event, with the error's own status."""
    async def scenario() -> None:
        engine, client, state = _StandInEngine(prompts=0), _Client(), _state(60.0)
        error = 'data: {"error": {"message": "bad tool", "type": "BadRequestError", "code": 400}}\n\n'
        call, _ = _handler(engine, first_event=error)
        with pytest.raises(APIError) as exc:
            await asyncio.wait_for(await _serve(client, state, call), 10)
        assert exc.value.status == 400 and not client.sent and state.admission.running == 0

    asyncio.run(scenario())
