"""Response bodies for completions and chat completions (plain dicts, OpenAI shapes)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ResponseFormat:
    """Builds the chunks and final body of one response; `chat` selects the schema."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _role_sent: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, choice: int, text: str, finish_reason: str | None) -> dict:
        """One streamed delta of one choice."""
        if not self.chat:
            return self._envelope([{"index": choice, "text": text, "logprobs": None,
                                    "finish_reason": finish_reason}], chunk=True)
        delta: dict = {"content": text}
        if choice not in self._role_sent:
            self._role_sent.add(choice)
            delta = {"role": "assistant", "content": text}
        return self._envelope([{"index": choice, "delta": delta, "logprobs": None,
                                "finish_reason": finish_reason}], chunk=True)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def full(self, texts: list[str], finish_reasons: list[str | None], prompt_tokens: int,
             completion_tokens: int) -> dict:
        """The non-streamed body with every choice."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish_reasons))]
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, finish_reasons))]
        body = self._envelope(choices, chunk=False)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
