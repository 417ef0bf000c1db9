"""Pure-ASGI middleware: the API-key check on every route but health, the request body's size cap
and read timeout, the count of refused generation requests, the access log."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_serve.service.errors import error_body
from moe_serve.service.metrics import COUNTED


async def _send_error(send: Send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def key_matches(presented: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Constant-time compare against every key (no early exit on the first match)."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented or b"", key)
    return ok and presented is not None


PUBLIC_PATHS = frozenset({"/health", "/ping"})  # liveness and readiness: never behind a key
VERSION_PATH = "/version"  # open, but shows details only to an authenticated caller
AUTHENTICATED = "moe_serve.authenticated"  # scope key: the caller presented a valid API key (or none is needed)


class AuthMiddleware:
    """One access rule: with API keys set, every path but PUBLIC_PATHS needs `Authorization:
    Bearer <key>` (401 otherwise), unknown paths included; /metrics needs `metrics_key` instead
    when one is set. /version passes without a key and reads scope[AUTHENTICATED]."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], metrics_key: str | None) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.metrics_keys = (metrics_key.encode(),) if metrics_key else ()

    def _keys_for(self, path: str) -> tuple[bytes, ...]:
        if path in PUBLIC_PATHS:
            return ()
        if path == "/metrics" and self.metrics_keys:
            return self.metrics_keys
        return self.api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            keys = self._keys_for(scope["path"])
            ok = not keys or key_matches(_bearer(scope), keys)
            scope[AUTHENTICATED] = ok
            if not ok and scope["path"] != VERSION_PATH:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await _send_error(send, 401, "invalid or missing API key (use 'Authorization: Bearer <key>')",
                                      "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes` (by Content-Length, or while streaming in); 408 for a
    body not complete `timeout_s` after the request reached the app (e.g. shorter than its
    Content-Length). Either way the app's own answer is dropped and the connection closed."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, 413, f"request body is larger than {self.max_bytes} bytes",
                                  "request_too_large")
                return
        seen = 0
        body_done = False
        refused: tuple[int, str, str] | None = None
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def limited_receive() -> Message:
            nonlocal seen, body_done, refused
            if body_done:  # later receives wait for a disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refused = (408, f"the request body did not arrive within {self.timeout_s:g} s", "timeout")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    refused = (413, f"request body is larger than {self.max_bytes} bytes", "request_too_large")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if refused is None:  # the app's answer to a truncated body is replaced by the refusal
                await send(message)

        await self.app(scope, limited_receive, guarded_send)
        if refused is not None:
            await _send_error(send, *refused, headers=[(b"connection", b"close")])


class RefusedRequestCounter:
    """Counts the POST /v1/... requests that ended before a route's observer counted them (scope
    key COUNTED): refused by the API key, the body limits, JSON parsing or validation, an unknown
    model or route. `count(scope, http_status)`: the status sent, None when none was (client gone)."""

    def __init__(self, app: ASGIApp, count: Callable[[Scope, int | None], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except Exception:
            status = status or 500
            raise
        finally:
            if not scope.get(COUNTED):
                self.count(scope, status)


class AccessLogMiddleware:
    """One line per request (method, path, status, duration, client); never bodies or keys."""

    def __init__(self, app: ASGIApp, as_json: bool) -> None:
        self.app = app
        self.as_json = as_json
        self.log = logging.getLogger("moe_serve.access")
        if as_json:  # whole lines of JSON for log shippers: no logging prefix
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.log.handlers = [handler]
            self.log.propagate = False
            self.log.setLevel(logging.INFO)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            client = scope.get("client") or ("-", 0)
            record = {"ts": round(time.time(), 3), "method": scope["method"], "path": scope["path"], "status": status,
                      "duration_ms": round((time.perf_counter() - began) * 1000, 2), "client": client[0]}
            self.log.info(json.dumps(record) if self.as_json else
                          "%(client)s %(method)s %(path)s %(status)s %(duration_ms)sms" % record)
