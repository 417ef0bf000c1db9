"""The expert load as JSON, behind the API key like every /v1 route (service/middleware.py).

GET /v1/moe/expert-load
    The full [layer x expert] matrix in three views (service/expert_load.py): ``total`` since
    serving began (warm-up excluded), ``window`` over the last ``window_s`` seconds (``window_span_s``
    while serving is younger), ``since_reset`` since the last reset. Each layer: its number in the
    model, vLLM's name, experts (logical ones under vLLM's EPLB), top-k, the three [E] lists of
    tokens per expert and their summaries (routed = tokens x top-k, tokens, imbalance = max / mean,
    idle experts), and ``out_of_range``: per view, the routing ids that named none of its experts. ``as_of``: the unix
    time of the oldest worker snapshot merged (snapshots every second). ``layers`` is empty until
    the workers serve, and for a model with no MoE layer.
POST /v1/moe/expert-load/reset
    ``since_reset`` starts from zero now: the workers report their counts at the reset (vLLM's
    collective_rpc), so a request that finished before it is never in ``since_reset``; 503 when
    they cannot (the engine not serving). The answer is the GET body after the reset. Nothing else
    is reset (the Prometheus counter stays monotonic).

Neither exists on a server started with --no-expert-stats (404, as any unknown path).
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from moe_serve.service.expert_load import ExpertLoadSource

router = APIRouter()
PATH = "/v1/moe/expert-load"


def _source(request: Request) -> ExpertLoadSource:
    source = request.app.state.server.expert_load
    assert source is not None, "the expert load routes are included only with expert stats on"
    return source


@router.get(PATH)
async def expert_load(request: Request) -> dict[str, Any]:
    state = request.app.state.server
    source = _source(request)
    await state.refresh_worker_reports()
    return source.body()


@router.post(PATH + "/reset")
async def reset_expert_load(request: Request) -> dict[str, Any]:
    state = request.app.state.server
    source = _source(request)
    await source.reset(state.engine.engine if state.engine.healthy else None)
    await state.refresh_worker_reports()
    return source.body()
