"""Every use of vLLM's OpenAI serving layer and internals, with per-version dispatch.

moe-serve runs on vLLM 0.32 (CPU: dev, CI), 0.26 (GPU host) and 0.33 (its wheel's source read and
this module's pins run on it without a GPU: only the argument parser's module moved). 0.26 and 0.32
put the same classes in different modules and construct the serving objects with different keyword arguments. Instead of
calling those constructors, `build_frontend` runs vLLM's own `init_app_state` (what `vllm serve`
runs) on an args namespace made by vLLM's own `vllm serve` argument parser, so the completion,
chat, responses, tokenization and models handlers are built exactly as `vllm serve` builds them, on every
version. Each name imported here is pinned by tests/test_vllm_compat.py (on 0.32); the 0.26
paths were read in vLLM 0.26.0's source, and the server runs on 0.26 on the GPU host.

| what                          | 0.32                                        | 0.26                               |
|-------------------------------|---------------------------------------------|------------------------------------|
| init_app_state                | entrypoints.launchers.api_server.app_state  | entrypoints.openai.api_server      |
| make_arg_parser, validate_... | entrypoints.launchers.cli_args (0.33: common.cli_args) | entrypoints.openai.cli_args |
| validate_api_server_args      | entrypoints.launchers.launcher              | entrypoints.openai.api_server      |
| ErrorResponse                 | entrypoints.serve.engine.protocol           | entrypoints.openai.engine.protocol |
| create_error_response         | entrypoints.serve                           | entrypoints.serve.utils.error_...  |
| client-error base class       | exceptions.VLLMClientError                  | VLLMValidationError, ...           |

Versions between 0.26 and 0.32 are untested; the split below follows the module layout.
"""

from __future__ import annotations

import traceback
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

ENGINE_MISSING = ("moe-serve needs an inference engine, installed with one of its extras: "
                  "pip install 'moe-serve[cpu]' (vLLM CPU 0.32.0, torch 2.13.0 CPU) or "
                  "pip install 'moe-serve[gpu]' (vLLM 0.26, 0.32 or 0.33 for NVIDIA GPUs); from a checkout, "
                  "bash service/setup.sh sets up the CPU engine")

try:
    import vllm
except ModuleNotFoundError as exc:
    if exc.name != "vllm":
        raise
    raise ModuleNotFoundError(ENGINE_MISSING, name="vllm") from exc
from vllm import exceptions as vllm_exceptions
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from vllm.entrypoints.serve.tokenize.protocol import (DetokenizeRequest, TokenizeChatRequest,
                                                      TokenizeCompletionRequest)
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

__all__ = ["CLIENT_ERRORS", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "EngineDeadError",
           "ErrorResponse", "Frontend", "RequestOutput", "RequestOutputKind", "ResponsesRequest", "ResponsesResponse",
           "TokenizeChatRequest", "TokenizeCompletionRequest", "VLLM_VERSION", "build_frontend", "error_response_for",
           "is_client_error", "merge_final", "pins_report", "serve_args"]


def _version_tuple(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


VLLM_VERSION = _version_tuple(vllm.__version__)
NEW_LAYOUT = VLLM_VERSION >= (0, 27)  # launchers/ and serve/ modules (0.32); openai/ (0.26)

if VLLM_VERSION >= (0, 33):
    from vllm.entrypoints.common import cli_args as _cli_args
elif NEW_LAYOUT:
    from vllm.entrypoints.launchers import cli_args as _cli_args  # type: ignore[no-redef]
if NEW_LAYOUT:
    from vllm.entrypoints.launchers import launcher as _launcher
    from vllm.entrypoints.launchers.api_server import app_state as _app_state
    from vllm.entrypoints.serve import create_error_response as _create_error_response
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    CLIENT_ERRORS: tuple[type[BaseException], ...] = (vllm_exceptions.VLLMClientError,)
else:  # 0.26
    from vllm.entrypoints.openai import api_server as _app_state  # type: ignore[no-redef]
    from vllm.entrypoints.openai import api_server as _launcher  # type: ignore[no-redef]
    from vllm.entrypoints.openai import cli_args as _cli_args  # type: ignore[no-redef]
    from vllm.entrypoints.openai.engine.protocol import ErrorResponse  # type: ignore[no-redef]
    from vllm.entrypoints.serve.utils.error_response import (  # type: ignore[no-redef]
        create_error_response as _create_error_response)

    CLIENT_ERRORS = (vllm_exceptions.VLLMValidationError, vllm_exceptions.VLLMUnprocessableEntityError,
                      vllm_exceptions.VLLMNotFoundError)

# 0.26 raises plain ValueErrors for invalid input in these modules (0.32: VLLMValidationError).
_INPUT_CHECK_MODULES = ("vllm/v1/engine/input_processor.py", "vllm/sampling_params.py", "vllm/renderers/",
                        "vllm/inputs/")


@dataclass
class Frontend:
    """vLLM's OpenAI handlers, built as `vllm serve` builds them."""

    completion: Any  # OpenAIServingCompletion
    chat: Any  # OpenAIServingChat
    responses: Any  # OpenAIServingResponses (the Responses API)
    tokenization: Any  # ServingTokenization
    models: Any  # OpenAIServingModels
    args: Namespace


def serve_args(model_path: str, served_name: str, extra: list[str]) -> Namespace:
    """The namespace `vllm serve --model PATH --served-model-name NAME EXTRA...` would parse."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = _cli_args.make_arg_parser(FlexibleArgumentParser(prog="moe-serve-frontend"))
    args = parser.parse_args(["--model", model_path, "--served-model-name", served_name, *extra])
    _cli_args.validate_parsed_serve_args(args)
    _launcher.validate_api_server_args(args)  # tool / reasoning parser names (KeyError if unknown)
    return args


async def build_frontend(engine_client: Any, args: Namespace) -> Frontend:
    """Run vLLM's own `init_app_state` into a private State and take its OpenAI handlers."""
    from starlette.datastructures import State

    state = State()
    tasks = await engine_client.get_supported_tasks()
    await _app_state.init_app_state(engine_client, state, args, tasks)
    return Frontend(completion=state.openai_serving_completion, chat=state.openai_serving_chat,
                    responses=state.openai_serving_responses, tokenization=state.serving_tokenization,
                    models=state.openai_serving_models, args=args)


def is_client_error(exc: BaseException) -> bool:
    """True when the engine rejected the request's input (HTTP 400), not for engine faults."""
    if isinstance(exc, CLIENT_ERRORS):
        return True
    if NEW_LAYOUT or type(exc) is not ValueError:
        return False
    frames = traceback.extract_tb(exc.__traceback__)  # 0.26: untyped ValueError from the input checks
    return bool(frames) and any(m in frames[-1].filename.replace("\\", "/") for m in _INPUT_CHECK_MODULES)


def error_response_for(exc: BaseException) -> Any:
    """vLLM's own ErrorResponse (status in `.error.code`) for an exception from its serving layer."""
    return _create_error_response(exc)


def pins_report() -> dict[str, Any]:
    """vLLM's version and whether moe-serve's pins on its internals hold for it (the plugin's
    moe_serve.kernels.plugin.vllm_pins.check_pins, as the plugin and bench/check_vllm_pins.py run them):
    {"version", "checked_versions", "pins_hold", "failed": {pin: error}}."""
    from moe_serve.kernels.plugin import vllm_compat as plugin_compat
    from moe_serve.kernels.plugin import vllm_pins

    failed = vllm_pins.check_pins()
    return {"version": vllm.__version__, "checked_versions": [".".join(map(str, v)) for v in plugin_compat.SUPPORTED],
            "pins_hold": not failed, "failed": failed}


def merge_final(first: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold DELTA outputs into what FINAL_ONLY would have returned (texts, token ids, logprobs)."""
    if first is None:
        return delta
    first.add(delta, aggregate=True)
    return first
