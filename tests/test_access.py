"""The access rule on real servers: with a key set, every route of the app but /health and
/ping needs it (/metrics its own key where one is set), unknown paths included; the docs routes
are off by default and behind the key when on; /version tells only the version to a caller
without the key; the served model name is the model directory's name, never its path.

The routes come from the app itself (`create_app(...).routes` with the server's flags), so a
route added later without the key's protection fails here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from starlette.routing import Route

from moe_serve.kernels.plugin.plugin_metrics import RUNTIME_DIR_ENV
from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess
from moe_serve.service import __version__
from moe_serve.service.app import create_app
from moe_serve.service.cli import settings_from_args
from tests.conftest import API_KEY, STRICT_KEY, STRICT_METRICS_KEY, strict_flags

pytestmark = pytest.mark.engine
PUBLIC = {"/health", "/ping"}
DOCS = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
WRONG = ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": "Basic " + API_KEY}, {"X-API-Key": API_KEY})


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str], model_path: str = "/unused"):
    """The app the server builds from `flags` (no engine started). create_app exports its runtime
    dir in the environment: kept to this test, so servers started later do not share it."""
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    return create_app(settings_from_args(flags), model_path)


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route; path parameters filled in."""
    out = []
    for route in app.routes:
        assert isinstance(route, Route) and route.methods, f"{route!r}: not an HTTP route; teach this test to reach it"
        out += [(method, re.sub(r"\{[^}]*\}", "x", route.path)) for method in sorted(route.methods)]
    return out


def _assert_401(resp: httpx.Response, method: str, path: str) -> None:
    assert resp.status_code == 401, (method, path, resp.status_code, resp.text[:200])
    assert resp.headers["www-authenticate"] == "Bearer"
    if method != "HEAD":
        assert resp.json()["error"]["code"] == "invalid_api_key", resp.text


def _check_routes(srv: ServerProcess, routes: list[tuple[str, str]], key: str, metrics_key: str) -> None:
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        for method, path in routes:
            good = metrics_key if path == "/metrics" else key
            for headers in (*WRONG, _bearer(metrics_key if good == key else key)):
                if headers == _bearer(good):
                    continue
                resp = http.request(method, path, headers=headers)
                if path in PUBLIC:
                    assert resp.status_code == 200, (method, path, resp.text[:200])
                elif path == "/version":
                    assert resp.status_code == 200 and (method == "HEAD" or resp.json() == {"version": __version__})
                else:
                    _assert_401(resp, method, path)
            resp = http.request(method, path, headers=_bearer(good))
            unknown_id = resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"  # vLLM's answer
            assert unknown_id or resp.status_code not in (401, 403, 404, 405), (method, path, resp.status_code,
                                                                                resp.text[:200])


def test_with_a_key_every_route_but_health_and_ping_needs_it(server: ServerProcess, monkeypatch, tmp_path) -> None:
    """The session server: --api-key, no metrics key (so /metrics takes the API key), docs off."""
    routes = _routes(_app(monkeypatch, tmp_path, ["--api-key", API_KEY]))
    paths = {path for _, path in routes}
    assert {"/health", "/ping", "/version", "/metrics", "/v1/models", "/v1/completions"} <= paths
    assert not paths & DOCS, "docs routes must be off by default"
    _check_routes(server, routes, API_KEY, API_KEY)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for path in (*DOCS, "/v1/nope", "/admin"):  # nothing else answers, and only to the key holder
            _assert_401(http.get(path), "GET", path)
            assert http.get(path, headers=_bearer(API_KEY)).status_code == 404, path


def test_docs_when_enabled_and_metrics_with_its_own_key(strict_server: ServerProcess, embedded_model_dir: str,
                                                        monkeypatch, tmp_path) -> None:
    """The strict server: --api-key, --metrics-api-key (the API key does not open /metrics, nor the
    metrics key anything else), --enable-docs (the docs need the key too)."""
    flags = [*strict_flags(embedded_model_dir), "--api-key", STRICT_KEY]
    routes = _routes(_app(monkeypatch, tmp_path, flags, embedded_model_dir))
    assert DOCS <= {path for _, path in routes}
    _check_routes(strict_server, routes, STRICT_KEY, STRICT_METRICS_KEY)
    with httpx.Client(base_url=strict_server.base_url, headers=_bearer(STRICT_KEY), timeout=30) as http:
        assert "swagger" in http.get("/docs").text.lower()
        assert "/v1/chat/completions" in http.get("/openapi.json").json()["paths"]


def test_version_details_only_with_the_key_and_never_the_model_path(server: ServerProcess,
                                                                   strict_server: ServerProcess,
                                                                   embedded_model_dir: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    name = Path(embedded_model_dir).name
    for srv, key, model in ((server, API_KEY, MODEL_NAME), (strict_server, STRICT_KEY, name)):
        assert httpx.get(srv.base_url + "/version").json() == {"version": __version__}
        resp = httpx.get(srv.base_url + "/version", headers=_bearer(key))
        details = resp.json()
        assert details["version"] == __version__ and details["vllm"] and details["model"] == model, details
        assert details["workers"] and all(w["pid"] for w in details["workers"]), details
        tokens, seqs = AsyncEngineArgs.get_batch_defaults(world_size=1)  # what vllm serve picks here
        assert details["engine_limits"] == {"max_model_len": 4096, "max_num_seqs": seqs[UsageContext.OPENAI_API_SERVER],
                                            "max_num_batched_tokens": tokens[UsageContext.OPENAI_API_SERVER]}, details
        assert embedded_model_dir not in resp.text


def test_without_any_key_version_keeps_its_details_but_not_the_model_path(embedded_model_dir: str, monkeypatch,
                                                                         tmp_path) -> None:
    """No key configured (as before): /version shows the details to anyone, still without the path.
    In-process (the real app and middleware, no engine): no other server runs with --model and no key."""
    import asyncio

    app = _app(monkeypatch, tmp_path, ["--model", embedded_model_dir], embedded_model_dir)

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return await c.get("/version")

    resp = asyncio.run(get())
    assert resp.json()["model"] == Path(embedded_model_dir).name and "vllm" in resp.json(), resp.text
    assert embedded_model_dir not in resp.text


def test_default_served_name_is_the_model_directory_name(strict_server: ServerProcess,
                                                         embedded_model_dir: str) -> None:
    """--model DIR without --served-model-name: clients see DIR's name in /v1/models, every
    response's `model` and the unknown-model 404, never the path."""
    name = Path(embedded_model_dir).name
    assert name != MODEL_NAME and "/" not in name
    with httpx.Client(base_url=strict_server.base_url, headers=strict_server.headers, timeout=60) as http:
        models = http.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == [name]
        completion = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert completion.json()["model"] == name
        chat = http.post("/v1/chat/completions", json={"model": name, "max_tokens": 2, "stream": True,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and f'"model":"{name}"' in chat.text
        missing = http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi", "max_tokens": 2})
        assert missing.status_code == 404 and name in missing.json()["error"]["message"]
        for resp in (models, completion, chat, missing):
            assert embedded_model_dir not in resp.text and str(Path(embedded_model_dir).parent) not in resp.text
