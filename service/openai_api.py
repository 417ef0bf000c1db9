"""OpenAI routes: /v1/completions, /v1/chat/completions, /v1/responses (and a stored response's
retrieval and cancel), /v1/models, /tokenize, /detokenize; and `vllm serve`'s /load.

Bodies are vLLM's own request models; vLLM's own handlers (built in moe_serve.service.vllm_compat) serve
them. These routes add what moe-serve owns: strict unknown-field rejection, the model-name and
engine checks, input limits, admission and the rest of `moe_serve.service.request_flow`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types.responses import ResponseOutputMessage

from moe_serve.service import vllm_compat as compat
from moe_serve.service.errors import APIError, from_vllm_error
from moe_serve.service.protocol import cap_output, check_common, check_messages, completion_slots, reject_unknown_fields
from moe_serve.service.request_flow import api_error_from_exception, serve
from moe_serve.service.state import ServerState
from moe_serve.service.strict_route import StrictJSONRoute

router = APIRouter(route_class=StrictJSONRoute)  # bodies parsed and checked strictly first


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _frontend(state: ServerState, model: str | None) -> compat.Frontend:
    """vLLM's handlers; 404 for another model name, 503 while the engine is not serving."""
    if model is not None and model != state.settings.model_name:
        raise APIError(404, f"model '{model}' does not exist; this server serves '{state.settings.model_name}'",
                       param="model", code="model_not_found")
    if not state.engine.healthy or state.engine.frontend is None:
        if state.engine.dead or state.engine.start_error is not None:
            raise APIError(503, "the engine has stopped; the server is shutting down", code="engine_dead")
        raise APIError(503, "the engine is still starting; retry shortly", code="engine_starting",
                       headers={"Retry-After": "5"})
    return state.engine.frontend


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """vLLM's model cards; `root` says the served name, never the model's path on disk."""
    state = _state(request)
    frontend = _frontend(state, None)
    cards = (await frontend.models.show_available_models()).model_dump()
    for card in cards["data"]:
        if card.get("root") == state.engine.model_path:
            card["root"] = card["id"]
    return cards


@router.post("/v1/completions")
async def create_completion(body: compat.CompletionRequest, request: Request) -> Response:
    state = _state(request)
    reject_unknown_fields(body)
    frontend = _frontend(state, body.model)
    check_common(body, state.settings)
    cap_output(body, ("max_tokens",), state.settings)
    slots = completion_slots(body, state.settings)
    return await serve(request, state, slots, lambda: frontend.completion.create_completion(body, request))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: compat.ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    reject_unknown_fields(body)
    frontend = _frontend(state, body.model)
    check_common(body, state.settings)
    check_messages(body, state.settings)
    cap_output(body, ("max_completion_tokens", "max_tokens"), state.settings)
    return await serve(request, state, body.n or 1, lambda: frontend.chat.create_chat_completion(body, request))


# Responses tools the client runs itself; the others (web search, code interpreter, MCP, ...) are run
# by vLLM's tool server (`--frontend-arg=--tool-server=...`), without which vLLM drops them silently.
CLIENT_TOOL_TYPES = frozenset({"function", "custom", "namespace"})


def _check_response_tools(body: compat.ResponsesRequest, frontend: compat.Frontend) -> None:
    if frontend.responses.tool_server is not None:
        return
    for i, tool in enumerate(body.tools):
        if tool.type not in CLIENT_TOOL_TYPES:
            raise APIError(400, f"tool type '{tool.type}' needs a tool server, which this server does not run "
                                f"(only function and custom tools)", param=f"tools.{i}.type", code="not_supported")


def _check_response_input(body: compat.ResponsesRequest) -> None:
    """vLLM turns an assistant output message of the input into chat text from its first content
    part's text (`vllm serve` answers 500 to one without): it needs an output_text part first."""
    if not isinstance(body.input, list):
        return
    for i, item in enumerate(body.input):
        if not isinstance(item, ResponseOutputMessage):
            continue
        if not item.content:
            raise APIError(400, "an assistant message input item needs at least one content part",
                           param=f"input.{i}.content", code="invalid_value")
        if getattr(item.content[0], "type", None) != "output_text":
            raise APIError(400, "the first content part of an assistant message input item must be output_text",
                           param=f"input.{i}.content.0.type", code="invalid_value")


class _JSONModel:
    """A vLLM answer whose `model_dump()` is the JSON form `vllm serve` sends (by alias, JSON mode)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def model_dump(self) -> dict:
        return self._model.model_dump(mode="json", by_alias=True)


async def _response_events(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """vLLM's Responses stream events as SSE, framed as `vllm serve` frames them."""
    try:
        async for event in events:
            data = event.model_dump_json(indent=None, by_alias=True)
            yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def _create_response(frontend: compat.Frontend, body: compat.ResponsesRequest, request: Request) -> Any:
    result = await frontend.responses.create_responses(body, request)
    if isinstance(result, compat.ResponsesResponse):
        return _JSONModel(result)
    if isinstance(result, compat.ErrorResponse):
        return result
    return _response_events(result)


@router.post("/v1/responses")
async def create_response(body: compat.ResponsesRequest, request: Request) -> Response:
    """The OpenAI Responses API on vLLM's own handler (stateless: vLLM stores no responses unless
    VLLM_ENABLE_RESPONSES_API_STORE=1, so `background` and `previous_response_id` get its errors)."""
    state = _state(request)
    reject_unknown_fields(body)
    frontend = _frontend(state, body.model)
    if frontend.responses is None:
        raise APIError(400, "this model does not support the Responses API", code="not_supported")
    if isinstance(body.input, list) and len(body.input) > state.settings.max_messages:
        raise APIError(400, f"at most {state.settings.max_messages} input items per request, got {len(body.input)}",
                       param="input", code="invalid_value")
    _check_response_tools(body, frontend)
    _check_response_input(body)
    cap_output(body, ("max_output_tokens",), state.settings)
    return await serve(request, state, 1, lambda: _create_response(frontend, body, request))


def _responses(request: Request) -> Any:
    """vLLM's Responses handler; 400 for a model without the Responses API."""
    frontend = _frontend(_state(request), None)
    if frontend.responses is None:
        raise APIError(400, "this model does not support the Responses API", code="not_supported")
    return frontend.responses


def _stored_answer(result: Any) -> Response:
    """A stored response (JSON), its events (SSE), or vLLM's error as ours."""
    if isinstance(result, compat.ErrorResponse):
        raise from_vllm_error(result.error.model_dump())
    if isinstance(result, compat.ResponsesResponse):
        return JSONResponse(result.model_dump(mode="json", by_alias=True))
    return StreamingResponse(_response_events(result), media_type="text/event-stream")


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, starting_after: int | None = None,
                            stream: bool = False) -> Response:
    """As `vllm serve`: a response vLLM stored (VLLM_ENABLE_RESPONSES_API_STORE=1; with `stream`, a
    background response's events after `starting_after`); vLLM's 404 for any other id."""
    return _stored_answer(await _responses(request).retrieve_responses(response_id, starting_after=starting_after,
                                                                        stream=stream))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """As `vllm serve`: cancels a stored background response still queued or running (400 for a
    finished one); vLLM's 404 for an id it has not stored."""
    return _stored_answer(await _responses(request).cancel_responses(response_id))


@router.get("/load")
async def server_load(request: Request) -> dict:
    """As `vllm serve`: {"server_load": n}; here n is the engine sequences admitted or waiting for
    admission (vllm serve counts requests, and only with --enable-server-load-tracking)."""
    admission = _state(request).admission
    return {"server_load": admission.running + admission.queued}


async def _tokenization_answer(call) -> JSONResponse:
    try:
        result = await call
    except Exception as exc:  # noqa: BLE001 - mapped like the generation routes
        raise api_error_from_exception(exc) from exc
    if isinstance(result, compat.ErrorResponse):
        raise from_vllm_error(result.error.model_dump())
    return JSONResponse(result.model_dump())


@router.post("/tokenize")
async def tokenize(body: compat.TokenizeCompletionRequest | compat.TokenizeChatRequest,
                   request: Request) -> JSONResponse:
    """As `vllm serve`: a prompt or chat messages -> tokens (templating off the event loop)."""
    reject_unknown_fields(body)
    state = _state(request)
    frontend = _frontend(state, body.model)
    if isinstance(body, compat.TokenizeChatRequest):
        check_messages(body, state.settings)
    return await _tokenization_answer(frontend.tokenization.create_tokenize(body, request))


@router.post("/detokenize")
async def detokenize(body: compat.DetokenizeRequest, request: Request) -> JSONResponse:
    """As `vllm serve`: token ids -> text."""
    reject_unknown_fields(body)
    state = _state(request)
    frontend = _frontend(state, body.model)
    vocab = len(state.engine.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens",
                       code="invalid_value")
    return await _tokenization_answer(frontend.tokenization.create_detokenize(body, request))
