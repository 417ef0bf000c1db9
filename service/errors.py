"""OpenAI-style error objects and the FastAPI exception handlers that emit them.

Every error body is `{"error": {"message", "type", "param", "code"}}`; internals
(tracebacks, paths) never reach the client. A message is at most MAX_MESSAGE_CHARS (vLLM's
validators quote the offending value, which can be megabytes): longer ones are cut, saying so.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 2000

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def bounded_message(message: str) -> str:
    """`message`, or its first MAX_MESSAGE_CHARS and how long it was."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... (cut: the message had {len(message)} characters)"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object for `status`."""
    return {
        "error": {
            "message": bounded_message(message),
            "type": _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "internal_error"),
            "param": param,
            "code": code if code is not None else HTTPStatus(status).phrase.lower().replace(" ", "_"),
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def from_vllm_error(error: dict) -> APIError:
    """Our error for vLLM's `{"message", "type", "param", "code": <HTTP status>}` (5xx text withheld)."""
    status = error.get("code") if isinstance(error.get("code"), int) else 500
    if status >= 500:
        return APIError(status, "internal error while generating", code="internal_error")
    return APIError(status, str(error.get("message") or HTTPStatus(status).phrase), param=error.get("param"))


def sse_error_event(err: APIError) -> str:
    """The final `data: {"error": ...}` event of a stream that failed after it started."""
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"


_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|\[")  # pydantic's union-member loc entries


def _param_of(loc: tuple) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages.0.role"; union-member tags dropped."""
    parts = [str(p) for p in loc[1:] if not _UNION_TAG.search(str(p))] if loc and loc[0] == "body" else \
        [str(p) for p in loc if not _UNION_TAG.search(str(p))]
    return ".".join(parts) or None


async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming each field (at most 5), pydantic's message and error type, as in `vllm serve`'s
    message (e.g. "seed: Input should be less than or equal to 9223372036854775807
    [type=less_than_equal]")."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    named = getattr((first.get("ctx") or {}).get("error"), "parameter", None)  # vLLM's validators name it
    message = "; ".join(f"{_param_of(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg', 'invalid')} "
                        f"[type={e.get('type', 'invalid')}]" for e in errors[:5])
    return error_response(APIError(400, message, param=named or _param_of(loc), code="invalid_value"))


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})))


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in request")
    return error_response(APIError(500, "internal server error", code="internal_error"))


async def _on_vllm_client_error(_: Request, exc: Exception) -> JSONResponse:
    """vLLM's request validators raise its own errors (0.32: not ValueErrors, so not pydantic's)."""
    from moe_serve.service import vllm_compat

    return error_response(from_vllm_error(vllm_compat.error_response_for(exc).error.model_dump()))


def install_error_handlers(app: FastAPI) -> None:
    """The handlers above, and this process's log bounded against clients' values (service/rejection_log.py)."""
    from moe_serve.service import vllm_compat  # heavy: vLLM
    from moe_serve.service.rejection_log import bound_logs

    bound_logs(vllm_compat.is_client_error)

    for cls in vllm_compat.CLIENT_ERRORS:
        app.add_exception_handler(cls, _on_vllm_client_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
