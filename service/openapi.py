"""The OpenAPI document (`--enable-docs`), corrected to say what the server answers and enforces.

FastAPI documents a 422 with its validation-error schema for every operation with input; this
server answers bad input with 400 and an OpenAI error object. vLLM's request models accept
`{}` for a completion and an empty `messages` list, which the server refuses: the document
states those constraints so that a client generated from it (or a schema-driven fuzzer) sends
what the server takes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_SCHEMA = {
    "type": "object", "title": "ErrorResponse", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE_STRING,
                       "code": _NULLABLE_STRING}}},
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _bad_input_is_400(schema: dict[str, Any]) -> None:
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if operation.get("responses", {}).pop("422", None) is not None:
                operation["responses"]["400"] = {"description": "Bad input (OpenAI error object)",
                                                 "content": {"application/json": {"schema": _ERROR_REF}}}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = ERROR_SCHEMA


def _non_empty(variant: dict[str, Any]) -> None:
    """A prompt variant as the server takes it: text of 1+ characters, 1+ items, 1+ token ids."""
    if variant.get("type") == "string":
        variant["minLength"] = 1
    elif variant.get("type") == "array":
        variant["minItems"] = 1
        if variant.get("items", {}).get("type") == "array":
            variant["items"]["minItems"] = 1


def _bodies_as_enforced(schema: dict[str, Any], prompt_embeds: bool) -> None:
    models = schema.get("components", {}).get("schemas", {})
    completion = models.get("CompletionRequest")
    if completion is not None:
        prompt = completion["properties"]["prompt"]
        prompt["anyOf"] = [v for v in prompt.get("anyOf", []) if v.get("type") != "null"]
        for variant in prompt["anyOf"]:
            _non_empty(variant)
        if prompt_embeds:
            completion["anyOf"] = [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}]
        else:  # refused without `vllm serve`'s --enable-prompt-embeds
            completion["properties"].pop("prompt_embeds", None)
            completion.setdefault("required", []).append("prompt")
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        if name in models:
            models[name]["properties"]["messages"]["minItems"] = 1


def install_openapi(app: FastAPI, prompt_embeds: bool) -> None:
    """Serve the corrected document at the app's openapi_url (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _bad_input_is_400(schema)
            _bodies_as_enforced(schema, prompt_embeds)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
