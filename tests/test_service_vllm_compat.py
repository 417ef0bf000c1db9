"""Pins every point where moe-serve touches vLLM internals (service/vllm_compat.py, on vLLM 0.32),
and the engine client's error classification and DELTA folding (no engine: a stand-in AsyncLLM
whose `generate` yields real vLLM `RequestOutput`s or raises real vLLM exceptions)."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from moe_serve.service import vllm_compat as compat
from moe_serve.service.admission import Admission
from moe_serve.service.engine_client import CURRENT, ObservedEngineClient, RequestContext
from moe_serve.service.errors import APIError
from moe_serve.service.metrics import ServiceMetrics
from moe_serve.service.request_flow import api_error_from_exception
from prometheus_client import CollectorRegistry


def test_dispatch_targets_exist_for_this_vllm() -> None:
    assert compat.VLLM_VERSION >= (0, 32) and compat.NEW_LAYOUT
    assert compat._app_state.__name__ == "vllm.entrypoints.launchers.api_server.app_state"
    assert list(inspect.signature(compat._app_state.init_app_state).parameters) == [
        "engine_client", "state", "args", "supported_tasks"]
    assert compat._cli_args.__name__ == ("vllm.entrypoints.common.cli_args" if compat.VLLM_VERSION >= (0, 33)
                                         else "vllm.entrypoints.launchers.cli_args")
    assert callable(compat._launcher.validate_api_server_args)
    assert compat.ErrorResponse.__module__ == "vllm.entrypoints.serve.engine.protocol"
    assert hasattr(RequestOutput, "add") and "aggregate" in inspect.signature(RequestOutput.add).parameters


def test_responses_api_pins() -> None:
    """The Responses route uses: the request/response models (same module on 0.26), the handler's
    create_responses(request, raw_request) and its tool_server (None without --tool-server)."""
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    assert compat.ResponsesRequest.__module__ == compat.ResponsesResponse.__module__ == \
        "vllm.entrypoints.openai.responses.protocol"
    assert list(inspect.signature(OpenAIServingResponses.create_responses).parameters) == [
        "self", "request", "raw_request"]
    assert "tool_server" in inspect.signature(OpenAIServingResponses.__init__).parameters


def test_serve_args_are_vllm_serve_args_and_bad_parser_names_fail() -> None:
    args = compat.serve_args("/models/x", "x", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.model == "/models/x" and args.served_model_name == ["x"]
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    with pytest.raises(KeyError):
        compat.serve_args("/models/x", "x", ["--enable-auto-tool-choice", "--tool-call-parser", "no-such-parser"])


def test_client_errors_are_told_apart_from_engine_faults() -> None:
    assert compat.is_client_error(VLLMValidationError("bad", parameter="n"))
    assert not compat.is_client_error(ValueError("an internal ValueError"))  # typed on 0.32
    assert not compat.is_client_error(RuntimeError("boom"))
    err = compat.error_response_for(VLLMValidationError("n is bad", parameter="n")).error
    assert (err.code, err.param) == (400, "n")
    assert api_error_from_exception(VLLMValidationError("x", parameter="seed")).status == 400
    assert api_error_from_exception(RuntimeError("a bug")).status == 500  # not a validation error: 500
    assert api_error_from_exception(OverflowError("id too large")).status == 400  # vLLM's input checks


def _output(text: str, ids: list[int], finish: str | None, finished: bool) -> RequestOutput:
    out = CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None,
                           finish_reason=finish)
    return RequestOutput("r", None, [1, 2, 3], None, [out], finished)


class _StandInEngine:
    """What ObservedEngineClient needs of AsyncLLM: `generate` (an async generator) and `errored`."""

    errored = False

    def __init__(self, outputs: list[RequestOutput] | None = None, error: BaseException | None = None) -> None:
        self.outputs, self.error, self.kinds = outputs or [], error, []

    async def generate(self, prompt, params, request_id, **_):
        self.kinds.append(params.output_kind)
        for out in self.outputs:
            yield out
        if self.error is not None:
            raise self.error


def _run(engine: _StandInEngine, kind: RequestOutputKind) -> tuple[list, RequestContext, SimpleNamespace]:
    handle = SimpleNamespace(engine=engine, active=set(), dead=False)
    handle.note_engine_failure = lambda exc: False
    ctx = RequestContext(ServiceMetrics(CollectorRegistry(), "m", reexport_default_registry=False).start(),
                         Admission(4, 4, None))

    async def consume() -> list:
        token = CURRENT.set(ctx)
        try:
            stream = ObservedEngineClient(handle).generate({"prompt_token_ids": [1, 2, 3]},
                                                           SamplingParams(output_kind=kind), "r")
        finally:
            CURRENT.reset(token)
        return [o async for o in stream]

    return asyncio.run(consume()), ctx, handle


def test_final_only_requests_run_as_delta_and_fold_into_one_final_output() -> None:
    engine = _StandInEngine([_output("Hel", [5], None, False), _output("lo", [6, 7], "length", True)])
    outs, ctx, handle = _run(engine, RequestOutputKind.FINAL_ONLY)
    assert engine.kinds == [RequestOutputKind.DELTA]
    assert len(outs) == 1 and outs[0].outputs[0].text == "Hello" and list(outs[0].outputs[0].token_ids) == [5, 6, 7]
    assert ctx.observer.generation_tokens == 3 and ctx.observer.prompt_tokens == 3
    assert ctx.observer.first_token_at is not None and handle.active == set()
    assert ctx.admission.prompt_tokens == 0  # the charge was released


def test_engine_faults_become_500_and_validation_errors_pass_through() -> None:
    with pytest.raises(APIError) as exc:
        _run(_StandInEngine(error=ValueError("engine-internal")), RequestOutputKind.DELTA)
    assert exc.value.status == 500
    with pytest.raises(VLLMValidationError):
        _run(_StandInEngine(error=VLLMValidationError("bad input", parameter="prompt")), RequestOutputKind.DELTA)


def test_an_aborted_engine_request_is_a_503_shutting_down() -> None:
    with pytest.raises(APIError) as exc:
        _run(_StandInEngine([_output("", [], "abort", True)]), RequestOutputKind.DELTA)
    assert (exc.value.status, exc.value.code) == (503, "shutting_down")
