"""The FastAPI application: lifespan (engine start/stop), health, liveness, version, metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from moe_serve.service import __version__
from moe_serve.service import kernel_tables
from moe_serve.service.engine import EngineHandle
from moe_serve.service.errors import install_error_handlers
from moe_serve.service.expert_load_api import router as expert_load_router
from moe_serve.service.memory_trim import trim_periodically
from moe_serve.service.middleware import (AUTHENTICATED, AccessLogMiddleware, AuthMiddleware, BodyLimitMiddleware,
                                RefusedRequestCounter)
from moe_serve.service.openai_api import router as openai_router
from moe_serve.service.profiling import profiler_configured
from moe_serve.service.profiling import router as profiling_router
from moe_serve.service.openapi import install_openapi
from moe_serve.service.settings import Settings
from moe_serve.service.state import ServerState
from moe_serve.service.warmup import is_warmup, warm_up_request_path
from moe_serve.service.worker_metrics import workers_summary

logger = logging.getLogger(__name__)
ENGINE_WATCH_INTERVAL_S = 1.0


def _request_exit(state: ServerState, why: str) -> None:
    """Ask the process to stop with a non-zero exit code (an orchestrator restarts it)."""
    logger.error("%s: shutting down with exit code 1", why)
    state.exit_code = 1
    os.kill(os.getpid(), signal.SIGTERM)


async def _check_kernel_tables(state: ServerState, model_path: str) -> None:
    """The model's MoE shapes against this GPU's tuned tables: warn per untuned shape, export
    the shape metrics, and with --tune-on-start tune them first (health stays 503)."""
    s = state.settings
    if s.moe_kernels != "optimized":
        return
    tp, quant, device = s.resolved_tensor_parallel_size(), s.quantization, kernel_tables.gpu_name()
    statuses = await asyncio.to_thread(kernel_tables.shape_statuses, model_path, tp, quant, device)
    if s.tune_on_start and device != "cpu" and any(not st.tuned for st in statuses):
        await asyncio.to_thread(kernel_tables.tune_on_start, model_path, tp, quant,
                                s.tune_budget_minutes)
        statuses = await asyncio.to_thread(kernel_tables.shape_statuses, model_path, tp, quant,
                                           device)
    kernel_tables.warn_untuned(statuses, model_path, tp, quant, device)
    kernel_tables.export(statuses, state.registry)


async def _configure_grammar_checker(state: ServerState) -> None:
    """Give the structured-output checker the engine's xgrammar setting: whitespace in JSON."""
    try:
        outputs = state.engine.engine.vllm_config.structured_outputs_config
        await state.grammar_checker.configure(any_whitespace=not outputs.disable_any_whitespace)
    except Exception:  # noqa: BLE001 - serve anyway: structured-output requests get 503 until it runs
        logger.exception("the structured-output checker did not start")


async def _start_and_watch_engine(app: FastAPI, state: ServerState, model_path: str) -> None:
    """Check the kernel tables, start the engine and the structured-output checker, warm the
    request path, then poll the engine; if it dies, fail health and exit non-zero."""
    try:
        await _check_kernel_tables(state, model_path)
    except Exception:  # noqa: BLE001 - a broken table check must not stop serving
        logger.exception("MoE kernel table check failed; serving with whatever tables load")
    try:
        await state.engine.start()
    except Exception:  # noqa: BLE001 - logged by start(); health stays 503
        _request_exit(state, "engine failed to start")
        return
    await _configure_grammar_checker(state)
    await warm_up_request_path(app, state)
    while not state.shutting_down:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        if not state.shutting_down and not state.engine.healthy:
            _request_exit(state, "engine core died")
            return


def create_app(settings: Settings, model_path: str) -> FastAPI:
    """Build the app; the engine starts in the background when the app starts."""
    state = ServerState.create(settings, EngineHandle(settings, model_path))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.grammar_checker.spawn()  # imports xgrammar while the engine loads
        watcher = asyncio.create_task(_start_and_watch_engine(app, state, model_path))
        trimmer = asyncio.create_task(trim_periodically(settings.malloc_trim_interval_s))
        try:
            yield
        finally:
            state.begin_shutdown()
            watcher.cancel()
            trimmer.cancel()
            await asyncio.gather(watcher, trimmer, return_exceptions=True)
            await state.grammar_checker.close()
            state.engine.shutdown()
            state.cleanup()

    docs = settings.enable_docs  # off by default; behind the API key (AuthMiddleware) when on
    app = FastAPI(title="moe-serve", version=__version__, lifespan=lifespan,
                  openapi_url="/openapi.json" if docs else None, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(openai_router)
    if settings.expert_stats:
        app.include_router(expert_load_router)  # GET /v1/moe/expert-load, POST .../reset
    if profiler_configured(settings):          # as vllm serve: only with a profiler configured
        app.include_router(profiling_router)
    if docs:
        install_openapi(app, prompt_embeds="--enable-prompt-embeds" in settings.frontend_args)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.healthy and state.warmed and not state.shutting_down:
            return JSONResponse({"status": "ok", "unfinished_requests": state.engine.num_unfinished_requests(),
                                 "running": state.admission.running, "queued": state.admission.queued})
        status = "starting" if not (state.engine.dead or state.engine.start_error) else "dead"
        if state.shutting_down:
            status = "shutting_down"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/ping")
    async def ping() -> dict:
        """Liveness: the process answers (the engine may still be starting; readiness is /health)."""
        return {"status": "alive"}

    for path, probe in (("/health", health), ("/ping", ping)):  # load balancers probe with HEAD
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/ping", ping, methods=["POST"], name="ping_post")  # POST too, as in vllm serve (SageMaker)

    @app.get("/version")
    async def version(request: Request) -> dict:
        """The moe-serve version; to an authenticated caller (or with no key set) also vLLM's,
        the served model name, the engine's batch limits and the workers' kernel reports."""
        if not request.scope.get(AUTHENTICATED):
            return {"version": __version__}
        try:
            import vllm

            vllm_version = vllm.__version__
        except ImportError:
            vllm_version = None
        await state.refresh_worker_reports()
        return {"version": __version__, "vllm": vllm_version, "vllm_pins": state.engine.vllm_pins,
                "model": settings.model_name, "moe_kernels": settings.moe_kernels,
                "fused_router": settings.uses_fused_router, "dense_gemv": settings.uses_dense_gemv,
                "engine_limits": state.engine.batch_limits(),
                **workers_summary(state.runtime_dir, state.remote_workers)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(_: Request) -> Response:
        await state.refresh_worker_reports()
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    def count_refused(scope: dict, http_status: int | None) -> None:
        metrics = state.warmup_metrics if is_warmup(Request(scope)) else state.metrics
        metrics.refused(http_status)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(AuthMiddleware, api_keys=settings.api_keys, metrics_key=settings.metrics_api_key)
    app.add_middleware(RefusedRequestCounter, count=count_refused)
    if settings.access_log:
        app.add_middleware(AccessLogMiddleware, as_json=settings.access_log_json)
    return app
