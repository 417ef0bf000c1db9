"""uvicorn's httptools HTTP/1.1 protocol with the guards it lacks, answering in OpenAI error objects.

uvicorn's httptools protocol reads headers of any size (one 16 MB header was read and answered
200), has no timer until a connection's first request is complete (a client that opens a
connection and sends a header byte now and then holds it forever), and answers protocol garbage
with a plain-text 400. Here, per connection:
- request line + headers over `max_header_bytes`: 431, connection closed;
- a request's headers not complete `header_timeout_s` after the connection opened or the request
  began: 408 (or, with nothing received yet, just closed);
- unparsable HTTP: 400; every one of these as `{"error": {...}}`, then the connection is closed
  (after LINGER_S of reading and dropping what the client still sends, so it gets the answer).
Idle keep-alive connections are closed by uvicorn's own `timeout_keep_alive`; the body's read
timeout is moe_serve.service.middleware.BodyLimitMiddleware's.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from moe_serve.service.errors import error_body


LINGER_S = 2.0  # after a refusal, what the client still sends is read and dropped this long, then closed


class _Refused(Exception):
    """Raised from a parser callback: the request is refused (the parser stops there)."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """Use `guarded_protocol(...)` for a class with the server's limits."""

    max_header_bytes = 64 * 1024
    header_timeout_s = 30.0

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - uvicorn's signature
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._reading_headers = False  # a request began and its headers are not complete yet
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._reading_headers:  # a request began: tell the client why
            self._refuse(408, f"the request headers took longer than {self.header_timeout_s:g} s", "timeout")
        else:  # nothing sent: an idle connection
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` with an OpenAI error object and close the connection."""
        self._refusal = (status, message, code)
        body = json.dumps(error_body(status, message, code=code)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        if self.transport.can_write_eof():  # lingering close: a client still sending gets the answer, not a reset
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.max_header_bytes:
            self._refusal = (431, f"the request line and headers are larger than {self.max_header_bytes} bytes",
                             "request_header_fields_too_large")
            raise _Refused()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is None:  # after a refusal the connection is closing: ignore the rest
            super().data_received(data)

    # httptools parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._reading_headers = True
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._cancel_header_timer()
        super().on_headers_complete()

    # uvicorn's answer to anything the parser rejects (a callback's _Refused included)
    def send_400_response(self, msg: str) -> None:
        status, message, code = self._refusal or (400, "invalid HTTP request", "invalid_http_request")
        self._refuse(status, message, code)


def guarded_protocol(max_header_bytes: int, header_timeout_s: float) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`) for these limits."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s})
