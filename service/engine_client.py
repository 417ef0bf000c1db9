"""The engine client vLLM's serving handlers talk to: AsyncLLM, with every engine request observed.

vLLM's OpenAI handlers call `engine_client.generate(...)` once per prompt. `ObservedEngineClient`
passes everything else through to the `AsyncLLM` and wraps `generate`, so that each engine request
of an HTTP request (found through the `CURRENT` context variable the route sets) is:
- charged against the admission prompt-token budget once its prompt is tokenized,
- observed token by token for the metrics (TTFT, ITL, tokens, finish reasons): FINAL_ONLY requests
  are run as DELTA and folded back into one final output, so non-streamed requests are timed too,
- tracked for `abort_all` (drain), and its failures classified: input rejected by the engine ->
  vLLM's own 400; engine core died -> 503; anything else -> 500 with the traceback logged,
- reported once the engine has accepted it (`AsyncLLM.add_request` returned: input processed,
  admission passed, sent to the engine core), so that a stream can start its response then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moe_serve.service import vllm_compat as compat
from moe_serve.service.errors import APIError
from moe_serve.service.metrics import RequestObserver

if TYPE_CHECKING:
    from moe_serve.service.admission import Admission

logger = logging.getLogger(__name__)


@dataclass
class RequestContext:
    """What one HTTP request's engine requests report to; `error` overrides vLLM's error text."""

    observer: RequestObserver
    admission: "Admission"
    error: APIError | None = None
    engine_requests: int = field(default=0)
    engine_accepted: int = field(default=0)
    all_accepted: asyncio.Event = field(default_factory=asyncio.Event)  # every engine request so far accepted

    def note_accepted(self) -> None:
        self.engine_accepted += 1
        if self.engine_accepted >= self.engine_requests:
            self.all_accepted.set()


CURRENT: ContextVar[RequestContext | None] = ContextVar("moe_serve_request", default=None)
# Set by an observed generate() in the task that is about to run `AsyncLLM.generate` up to its
# `add_request`: whom to tell once the engine has accepted that request.
_ON_ACCEPTED: ContextVar[Callable[[], None] | None] = ContextVar("moe_serve_on_accepted", default=None)


def report_acceptance(engine: Any) -> None:
    """Make `engine.add_request` (called by `AsyncLLM.generate` before it waits for outputs; same
    in vLLM 0.26, 0.32 and 0.33) tell the observed generate() that started it once it has returned."""
    add_request = engine.add_request

    @functools.wraps(add_request)
    async def add_request_reported(*args: Any, **kwargs: Any) -> Any:
        on_accepted = _ON_ACCEPTED.get()
        if on_accepted is None:
            return await add_request(*args, **kwargs)
        _ON_ACCEPTED.set(None)  # this task's next add_request belongs to someone else
        collector = await add_request(*args, **kwargs)
        on_accepted()
        return collector

    engine.add_request = add_request_reported


def _prompt_len(prompt: Any) -> int:
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    return len(ids) if ids is not None else 0


class ObservedEngineClient:
    """Duck-typed `EngineClient`: `AsyncLLM` attributes, plus an observed `generate`."""

    def __init__(self, handle: Any) -> None:
        """`handle`: the moe_serve.service.engine.EngineHandle (engine, active, note_engine_failure)."""
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle.engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                 **kwargs: Any) -> AsyncIterator[Any]:
        """Same contract as `AsyncLLM.generate`; bound to the calling HTTP request's context."""
        ctx = CURRENT.get()
        if ctx is not None:
            ctx.engine_requests += 1
        index = ctx.engine_requests if ctx is not None else 0
        return self._generate(ctx, index, prompt, sampling_params, request_id, args, kwargs)

    async def _generate(self, ctx: RequestContext | None, index: int, prompt: Any, params: Any,
                        request_id: str, args: tuple, kwargs: dict) -> AsyncIterator[Any]:
        handle = self._handle
        final_only = params.output_kind == compat.RequestOutputKind.FINAL_ONLY
        if final_only:
            params.output_kind = compat.RequestOutputKind.DELTA
        tokens = _prompt_len(prompt)
        charge = await ctx.admission.charge(tokens) if ctx is not None else None
        if ctx is not None:
            ctx.observer.prompt_tokens += tokens
        stream = handle.engine.generate(prompt, params, request_id, *args, **kwargs)
        handle.active.add(request_id)
        if ctx is not None:
            _ON_ACCEPTED.set(ctx.note_accepted)  # read by add_request in this task, on the first anext
        merged = None
        try:
            async for out in stream:
                if ctx is not None:
                    for o in out.outputs:
                        ctx.observer.on_tokens((index, o.index), len(o.token_ids), o.finish_reason)
                        if o.finish_reason == "abort":  # only the server aborts a live request (drain)
                            raise APIError(503, "request aborted: the server is shutting down",
                                           code="shutting_down")
                if not final_only:
                    yield out
                    continue
                merged = compat.merge_final(merged, out)
                if out.finished:
                    yield merged
        except APIError as exc:
            _remember(ctx, exc)
            raise
        except Exception as exc:
            raise _classified(handle, ctx, exc) from exc
        finally:
            _ON_ACCEPTED.set(None)  # spent, or never taken (the engine failed before add_request)
            handle.active.discard(request_id)
            if charge is not None:
                charge.release()
            await stream.aclose()


def _remember(ctx: RequestContext | None, err: APIError) -> None:
    if ctx is not None and ctx.error is None:
        ctx.error = err


def _classified(handle: Any, ctx: RequestContext | None, exc: Exception) -> Exception:
    """Engine-input errors pass through (vLLM answers 400 naming the parameter); others become APIError."""
    if handle.note_engine_failure(exc):
        err = APIError(503, "the engine has stopped; the server is shutting down", code="engine_dead")
    elif compat.is_client_error(exc):
        return exc
    else:
        logger.error("engine request failed", exc_info=exc)
        err = APIError(500, "internal error while generating", code="internal_error")
    _remember(ctx, err)
    return err
