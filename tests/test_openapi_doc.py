"""The OpenAPI document (--enable-docs, the strict server) says what the server answers and enforces."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.server_proc import ServerProcess

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def doc(strict_server: ServerProcess) -> dict:
    resp = httpx.get(strict_server.base_url + "/openapi.json", headers=strict_server.headers, timeout=60)
    assert resp.status_code == 200
    return resp.json()


def _operations(doc: dict):
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_bad_input_is_documented_as_400_with_the_error_object_never_422(doc: dict) -> None:
    with_body = [(p, m, op) for p, m, op in _operations(doc) if "requestBody" in op]
    assert {p for p, _, _ in with_body} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for path, method, op in _operations(doc):
        assert "422" not in op["responses"], (path, method)
    for path, method, op in with_body:
        schema = op["responses"]["400"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, method)
    error = doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_metrics_are_documented_as_text(doc: dict, strict_server: ServerProcess) -> None:
    content = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    from tests.conftest import STRICT_METRICS_KEY

    served = httpx.get(strict_server.base_url + "/metrics", headers={"Authorization": f"Bearer {STRICT_METRICS_KEY}"})
    assert served.headers["content-type"].startswith("text/plain")


def test_the_schema_refuses_what_the_server_refuses(doc: dict, strict_server: ServerProcess,
                                                    embedded_model_dir: str) -> None:
    """`{}` and an empty prompt for completions, `messages: []` for chat: the document rules them
    out, the server refuses them, and the smallest bodies the document allows are served."""
    models = doc["components"]["schemas"]
    completion, chat = models["CompletionRequest"], models["ChatCompletionRequest"]
    assert "prompt" in completion["required"] and "prompt_embeds" not in completion["properties"]
    variants = completion["properties"]["prompt"]["anyOf"]
    assert {"type": "null"} not in variants
    assert all(v.get("minLength") == 1 or v.get("minItems") == 1 for v in variants)
    assert chat["properties"]["messages"]["minItems"] == 1
    assert models["TokenizeChatRequest"]["properties"]["messages"]["minItems"] == 1
    model = Path(embedded_model_dir).name
    with httpx.Client(base_url=strict_server.base_url, headers=strict_server.headers, timeout=60) as http:
        for path, body in (("/v1/completions", {}), ("/v1/completions", {"prompt": ""}),
                           ("/v1/completions", {"prompt": []}), ("/v1/chat/completions", {"messages": []})):
            assert http.post(path, json=body).status_code == 400, (path, body)
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "model": model}).status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 1, "model": model}).status_code == 200
