"""Request checks moe-serve adds around vLLM's own OpenAI request models (vllm_compat re-exports them).

vLLM's request models accept unknown fields and ignore them (extra="allow"). Here every unknown
field, at any depth of the pydantic models, is a 400 naming it, except `ALLOWED_EXTRA_FIELDS` at
the top level (OpenAI fields with no effect on a self-hosted server). Then the server's own input
limits (n, stop strings, batch size, message count, output cap) are applied, before admission and
before anything is tokenized.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from moe_serve.service.errors import APIError
from moe_serve.service.settings import Settings

# OpenAI request fields that vLLM does not know and that change nothing here (no storage, no
# tiers, no prompt-cache routing): accepted and ignored. `user` is a vLLM field (also ignored).
ALLOWED_EXTRA_FIELDS = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def reject_unknown_fields(model: BaseModel, prefix: str = "") -> None:
    """400 for the first field that no model of the request declares (allowlist at the top only)."""
    for key in model.model_extra or {}:
        if not prefix and key in ALLOWED_EXTRA_FIELDS:
            continue
        name = prefix + key
        raise APIError(400, f"unknown field '{name}': this server does not support it", param=name,
                       code="unknown_parameter")
    for key, value in model.__dict__.items():
        _check_nested(value, f"{prefix}{key}")


def _check_nested(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        reject_unknown_fields(value, path + ".")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel):
                reject_unknown_fields(item, f"{path}.{i}.")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range; vLLM clamps into it silently


def check_common(req: Any, settings: Settings) -> None:
    """Limits shared by completions and chat: n, stop strings, logit_bias values."""
    n = req.n or 1
    if n > settings.max_n:
        raise APIError(400, f"n must be <= {settings.max_n}, got {n}", param="n", code="invalid_value")
    stops = _stop_list(req.stop)
    if len(stops) > settings.max_stop_sequences:
        raise APIError(400, f"at most {settings.max_stop_sequences} stop sequences are allowed, got {len(stops)}",
                       param="stop", code="invalid_value")
    if any(s == "" for s in stops):
        raise APIError(400, "stop sequences must be non-empty", param="stop", code="invalid_value")
    low, high = LOGIT_BIAS_RANGE
    for token, bias in (req.logit_bias or {}).items():
        if not low <= bias <= high:  # also false for NaN
            raise APIError(400, f"logit_bias values must be in [{low:g}, {high:g}], got {bias!r} for token "
                           f"{token[:20]!r}", param="logit_bias", code="invalid_value")


def cap_output(req: Any, fields: tuple[str, ...], settings: Settings) -> None:
    """Apply --max-tokens-limit (400 if asked for more) and --default-max-tokens (if none asked)."""
    name = next((f for f in fields if getattr(req, f, None) is not None), None)
    limit = settings.max_tokens_limit
    if name is not None:
        asked = getattr(req, name)
        if limit is not None and asked > limit:
            raise APIError(400, f"{name} must be <= {limit}, got {asked}", param=name, code="invalid_value")
        return
    caps = [c for c in (settings.default_max_tokens, limit) if c is not None]
    if caps:
        setattr(req, fields[0], min(caps))


def completion_slots(req: Any, settings: Settings) -> int:
    """Admission slots of a completion request (prompts x n); 400 beyond --max-batch-prompts."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        count = len(prompt)  # a batch of texts or of token-id lists
    else:
        count = 1
    if count > settings.max_batch_prompts:
        raise APIError(400, f"at most {settings.max_batch_prompts} prompts per request, got {count}",
                       param="prompt", code="invalid_value")
    return count * (req.n or 1)


def check_messages(req: Any, settings: Settings) -> None:
    """At most --max-messages messages (their size is bounded by --max-request-bytes), each an
    OpenAI message object (vLLM's union also admits harmony `Message` models, which its chat
    renderer then cannot read: a 500 in `vllm serve`)."""
    count = len(req.messages)
    if count > settings.max_messages:
        raise APIError(400, f"at most {settings.max_messages} messages per request, got {count}",
                       param="messages", code="invalid_value")
    for i, message in enumerate(req.messages):
        if not isinstance(message, dict) or "role" not in message:
            raise APIError(400, f"messages.{i} must be an object with a 'role'", param=f"messages.{i}",
                           code="invalid_value")
