"""Turn a validated request into prompt token ids and vLLM `SamplingParams`.

All limit checks that need the tokenizer or the context length live here and raise
`APIError(400)` with the offending parameter named.
"""

from __future__ import annotations

from typing import Any

from service.errors import APIError
from service.protocol import SamplingFields
from service.settings import Settings


def check_common_limits(req: SamplingFields, settings: Settings) -> None:
    """Limits that hold before tokenization (n, stop strings)."""
    if req.n > settings.max_n:
        raise APIError(400, f"n must be <= {settings.max_n}, got {req.n}", param="n", code="invalid_value")
    stops = req.stop_list()
    if len(stops) > settings.max_stop_sequences:
        raise APIError(400, f"at most {settings.max_stop_sequences} stop sequences are allowed, got {len(stops)}",
                       param="stop", code="invalid_value")
    if any(s == "" for s in stops):
        raise APIError(400, "stop sequences must be non-empty", param="stop", code="invalid_value")
    if req.top_k is not None and req.top_k != -1 and req.top_k < 1:
        raise APIError(400, "top_k must be -1 (off) or >= 1", param="top_k", code="invalid_value")


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """Token-id prompts must be non-empty and inside the vocabulary."""
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="prompt",
                       code="invalid_value")


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, max_model_len: int,
                       settings: Settings, *, param: str, prompt_param: str) -> int:
    """Output-token budget for one prompt; 400 if the prompt or the request does not fit."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"prompt has {prompt_len} tokens, which does not fit the model's context of "
                       f"{max_model_len} tokens", param=prompt_param, code="context_length_exceeded")
    room = max_model_len - prompt_len
    if requested is None:
        max_tokens = room if default is None else min(default, room)
    elif requested > room:
        raise APIError(400, f"{param}={requested} plus the prompt's {prompt_len} tokens exceeds the model's "
                       f"context of {max_model_len} tokens", param=param, code="context_length_exceeded")
    else:
        max_tokens = requested
    if settings.max_tokens_limit is not None and max_tokens > settings.max_tokens_limit:
        if requested is None:
            return settings.max_tokens_limit
        raise APIError(400, f"{param} must be <= {settings.max_tokens_limit}, got {max_tokens}", param=param,
                       code="invalid_value")
    return max_tokens


def sampling_params(req: SamplingFields, max_tokens: int, stream: bool) -> Any:
    """vLLM `SamplingParams`; DELTA outputs for streams, FINAL_ONLY otherwise."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    kwargs: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "stop": req.stop_list() or None,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "min_tokens": min(req.min_tokens, max_tokens),
        "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    }
    if req.temperature is not None:
        kwargs["temperature"] = req.temperature
    if req.top_p is not None:
        kwargs["top_p"] = req.top_p
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    if req.presence_penalty is not None:
        kwargs["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty is not None:
        kwargs["frequency_penalty"] = req.frequency_penalty
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # vLLM's own range checks
        raise APIError(400, str(exc), code="invalid_value") from exc
