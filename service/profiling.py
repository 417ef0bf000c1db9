"""`POST /start_profile` and `POST /stop_profile`, as `vllm serve` has them: only when vLLM's
profiler is configured (`--engine-arg profiler_config='{"profiler": "torch", "torch_profiler_dir":
"/abs/dir"}'`), behind the API key like every route, through vLLM's own engine client
(`AsyncLLM.start_profile` / `stop_profile`; the engine's workers write the traces)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from moe_serve.service.errors import APIError
from moe_serve.service.settings import Settings
from moe_serve.service.state import ServerState

router = APIRouter()


def profiler_configured(settings: Settings) -> bool:
    """True when the engine args name a vLLM profiler (as vllm serve's --profiler-config does)."""
    cfg: Any = settings.engine_args.get("profiler_config")
    profiler = cfg.get("profiler") if isinstance(cfg, dict) else getattr(cfg, "profiler", None)
    return profiler is not None


def _engine(request: Request) -> Any:
    state: ServerState = request.app.state.server
    if not state.engine.healthy:
        raise APIError(503, "the engine is not serving", code="engine_not_ready")
    return state.engine.engine


@router.post("/start_profile")
async def start_profile(request: Request) -> Response:
    await _engine(request).start_profile()
    return Response(status_code=200)


@router.post("/stop_profile")
async def stop_profile(request: Request) -> Response:
    await _engine(request).stop_profile()
    return Response(status_code=200)
