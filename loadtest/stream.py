"""Timing one streamed OpenAI response: TTFT, inter-token latency, e2e, output tokens.

Engine-neutral: the caller feeds SSE lines with the time each arrived. TTFT is the time
from sending the request to the first chunk with non-empty content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of a streamed request with a known output length."""
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                  "temperature": 0.0, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def stream_into(timer: StreamTimer, client: Any, url: str, body: dict, headers: dict,
                      clock: Callable[[], float]) -> None:
    """POST body to url as a stream (httpx.AsyncClient), feeding every SSE line to `timer`
    (until it has seen the end); a non-200 answer becomes timer.error. Transport errors raise."""
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            timer.error = error_message(resp.status_code, await resp.aread())
            return
        done = False
        async for line in resp.aiter_lines():
            if not done:
                done = timer.line(line, clock())


def error_message(status: int, body: bytes | str) -> str:
    """The server's error message from an OpenAI error body, else the raw body."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        return f"HTTP {status}: {json.loads(text)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {text[:300]}"


@dataclass
class StreamTimer:
    """Feed `line(text, now)` for every received line; read the outcome when done."""

    t_send: float
    t_first: float | None = None
    t_last: float | None = None
    t_done: float | None = None
    chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None

    def line(self, raw: bytes | str, now: float) -> bool:
        """Consume one SSE line; True once the stream is finished ([DONE] or an error)."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        text = text.strip()
        if not text.startswith("data:"):
            return False
        data = text[5:].strip()
        if data == "[DONE]":
            self.t_done = now
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = f"bad stream event: {data[:200]}"
            return True
        if "error" in obj:
            err = obj["error"]
            self.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
            return True
        if obj.get("usage"):
            self.usage_tokens = obj["usage"].get("completion_tokens")
            self.prompt_tokens = obj["usage"].get("prompt_tokens")
        for choice in obj.get("choices") or ():
            content = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if content:
                self.chunks += 1
                self.t_last = now
                if self.t_first is None:
                    self.t_first = now
        return False

    def finish(self, now: float) -> None:
        """Call when the connection ended; flags streams that ended without [DONE] or content."""
        if self.t_done is None:
            self.t_done = now
            if self.error is None:
                self.error = "stream ended without [DONE]"
        if self.error is None and self.t_first is None:
            self.error = "stream had no content"

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def itl(self) -> float | None:
        """Mean time per output token after the first (decode time / (tokens - 1))."""
        n = self.output_tokens
        if self.t_first is None or self.t_last is None or n < 2:
            return None
        return (self.t_last - self.t_first) / (n - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_send
