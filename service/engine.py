"""The engine handle: one vLLM `AsyncLLM` (a.k.a. AsyncLLMEngine), started in the background.

The HTTP server comes up first and answers `/health` with 503 until `start()` has
finished; requests then go through `generate()`, which yields vLLM `RequestOutput`s
and aborts the engine request if the caller stops iterating (client disconnect).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any

from moe_serve.service.settings import Settings, visible_gpu_count
from moe_serve.service.tokenizer_cache import BPE_CACHE_ENTRIES, bound_bpe_caches

logger = logging.getLogger(__name__)
# How long the engine core and its workers get to exit by themselves after SIGTERM before vLLM
# force-kills them (vLLM's default: 5 s for each). Their teardown ends in interpreter finalization,
# whose full garbage collections over the startup heap took 4-14 s per process on a 2-core machine
# (vLLM issue #48620 reports 4-7 s on GPU hosts), so the defaults ended in a force kill. The
# engine core waits for its workers first, so it gets the workers' grace plus its own.
WORKER_EXIT_GRACE_S = 45
ENGINE_EXIT_GRACE_S = 75.0
JIT_PHASE_RPC_TIMEOUT_S = 30.0
RUNNER_GATE_KEY = "moe_serve_runner_gate"  # in vLLM's additional_config: a compile-cache key of its own
EXPERT_STATS_KEY = "moe_serve_expert_stats"  # likewise, for the expert load counting the graph holds
EXPERT_STATS_GRAPH = 1  # its value: change it when the counting traced into the graph changes
DENSE_GEMV_KEY = "moe_serve_dense_gemv"  # likewise, for the dense GEMV op traced into the graph
DENSE_GEMV_GRAPH = 1  # its value: change it when what the wrapper traces changes


class EngineNotReady(RuntimeError):
    """The engine is still starting (or failed to start)."""


class EngineDead(RuntimeError):
    """The engine core died; the server cannot serve any more."""


def build_engine_args(settings: Settings, model_path: str) -> Any:
    """vLLM `AsyncEngineArgs` as `vllm serve --model PATH` parses them (vLLM's own parser, so every
    field moe-serve does not set keeps its CLI default), with the settings on top (pass-through
    args win)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from moe_serve.service import vllm_compat

    serve_defaults = AsyncEngineArgs.from_cli_args(vllm_compat.serve_args(model_path, settings.model_name, []))
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": [settings.model_name],
        "tensor_parallel_size": settings.resolved_tensor_parallel_size(),
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "dtype": settings.dtype,
        "disable_log_stats": False,
    }
    if settings.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    elif visible_gpu_count() == 0:
        # On CPU the "gpu" fraction is of host RAM and fails when other processes use
        # memory; a fixed KV-cache budget starts reliably.
        kwargs["kv_cache_memory_bytes"] = settings.cpu_kv_cache_bytes
    else:
        kwargs["gpu_memory_utilization"] = 0.9
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.quantization:
        kwargs["quantization"] = settings.quantization
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.distributed_executor_backend:
        kwargs["distributed_executor_backend"] = settings.distributed_executor_backend
    if settings.model is None:  # the embedded model: see EMBEDDED_STRUCTURED_OUTPUTS
        kwargs["structured_outputs_config"] = dict(EMBEDDED_STRUCTURED_OUTPUTS)
    kwargs.update(settings.engine_args)
    if isinstance(kwargs.get("structured_outputs_config"), dict):  # e.g. from --engine-arg as JSON
        from vllm.config import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(**kwargs["structured_outputs_config"])
    if isinstance(kwargs.get("profiler_config"), dict):  # as vllm serve's --profiler-config JSON
        from vllm.config import ProfilerConfig

        kwargs["profiler_config"] = ProfilerConfig(**kwargs["profiler_config"])
    # the plugin's settings (kernels/config.py): every field, so an engine process's environment
    # cannot undo a flag; vLLM hashes additional_config into its compile cache's key
    kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}),
                                   **settings.plugin_config().additional_config()}
    if settings.uses_fused_router:
        # kernels/models/runner_gate.py changes what torch.compile traces (a Mixtral block's gate
        # moves into vLLM's MoE op). vLLM's AOT compile cache keys on the config, not on the traced
        # files: without a key of its own, a graph traced with or without the move could load in a
        # server of the other kind.
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), RUNNER_GATE_KEY: True}
    if settings.uses_dense_gemv:
        # kernels/plugin/dense_hook.py puts moe-serve's dense_linear op into the traced graph in
        # place of F.linear: a graph traced without it must not load in a server that uses it.
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), DENSE_GEMV_KEY: DENSE_GEMV_GRAPH}
    if settings.expert_stats and visible_gpu_count() == 0:
        # On vLLM's CPU engine the counting (kernels/plugin/expert_load.py) is traced into the
        # compiled graph (on CUDA it runs inside vLLM's opaque MoE op, the graph is the same): a
        # graph traced without it must not load in a server that counts.
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), EXPERT_STATS_KEY: EXPERT_STATS_GRAPH}
    from moe_serve.kernels.plugin import backend_policy

    backend_policy.apply(kwargs, settings.moe_kernels, model_path)  # an explicit moe_backend wins
    return dataclasses.replace(serve_defaults, **kwargs)


def build_async_llm(args: Any) -> Any:
    """The `AsyncLLM` of `args`, configured as `vllm serve` configures its own: in the OpenAI API
    server's usage context, whose batch defaults (max_num_batched_tokens, max_num_seqs; by GPU
    kind and memory) vLLM picks for serving. The engine context's are smaller (on an H200,
    max_num_batched_tokens 2048 against `vllm serve`'s 8192)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER)


EMBEDDED_TOOL_PARSER = "hermes"
# A random-weight model, left free, fills JSON with whitespace until max_tokens: the embedded model's
# structured outputs allow none (vLLM's `--structured-outputs-config` of the same name).
EMBEDDED_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def frontend_flags(settings: Settings) -> list[str]:
    """`vllm serve` flags for vLLM's OpenAI layer (tool calling, reasoning, chat template, extras)."""
    flags: list[str] = []
    parser = settings.tool_call_parser
    auto = settings.enable_auto_tool_choice
    if settings.model is None and parser is None:  # the embedded model's template writes Hermes tool calls
        parser, auto = EMBEDDED_TOOL_PARSER, True
    if auto:
        flags.append("--enable-auto-tool-choice")
    if parser:
        flags += ["--tool-call-parser", parser]
    if settings.reasoning_parser:
        flags += ["--reasoning-parser", settings.reasoning_parser]
    if settings.chat_template:
        flags += ["--chat-template", settings.chat_template]
    return flags + list(settings.frontend_args)


class EngineHandle:
    """Owns the `AsyncLLM` and vLLM's OpenAI handlers around it: start, abort, health, shutdown."""

    def __init__(self, settings: Settings, model_path: str) -> None:
        self.settings = settings
        self.model_path = model_path
        self.engine: Any = None
        self.tokenizer: Any = None
        self.max_model_len: int = 0
        self.start_error: BaseException | None = None
        self.startup_seconds: float | None = None
        self.ready = asyncio.Event()
        self.dead = False
        self.active: set[str] = set()  # engine request ids being generated now
        self.frontend: Any = None  # moe_serve.service.vllm_compat.Frontend: vLLM's OpenAI handlers
        self.vllm_pins: dict[str, Any] | None = None  # check_vllm_pins(), once start() has run it

    async def start(self) -> None:
        """Build the engine (blocking work runs in a thread); set `ready` or `start_error`."""
        from moe_serve.kernels.plugin.vllm_plugin import ENABLE_ENV as PLUGIN_ENABLE_ENV

        began = time.perf_counter()
        # Read by the plugin in every engine process, which inherits it: it marks the processes moe-serve
        # starts (elsewhere, e.g. a plain `vllm serve` in this environment, the plugin is inert). The
        # plugin's settings go in the engine args' additional_config (build_engine_args).
        os.environ[PLUGIN_ENABLE_ENV] = "1"
        try:
            from moe_serve.service import vllm_compat
            from moe_serve.service.engine_client import ObservedEngineClient, report_acceptance

            serve_args = vllm_compat.serve_args(self.model_path, self.settings.model_name,
                                                frontend_flags(self.settings))  # bad parser names fail here
            args = build_engine_args(self.settings, self.model_path)
            logger.info("starting vLLM engine: model=%s tp=%s", self.model_path, args.tensor_parallel_size)
            pins = asyncio.get_running_loop().run_in_executor(None, check_vllm_pins)  # beside the engine start
            # Built in a thread so /health answers 503 meanwhile; AsyncLLM starts its output
            # handler lazily on the first request when built outside the event loop.
            building = asyncio.get_running_loop().run_in_executor(None, build_async_llm, args)
            try:
                self.engine = await asyncio.shield(building)
            except asyncio.CancelledError:  # shutdown during start: finish building, then stop it
                logger.info("shutdown requested during engine start; stopping the engine once it is up")
                self.engine = await building
                raise
            report_acceptance(self.engine)
            self.tokenizer = self.engine.get_tokenizer()
            bounded = bound_bpe_caches(self.tokenizer)
            logger.info("BPE cache bounded to %d entries in %d tokenizer object(s)", BPE_CACHE_ENTRIES, bounded)
            self.max_model_len = int(self.engine.model_config.max_model_len)
            self.frontend = await vllm_compat.build_frontend(ObservedEngineClient(self), serve_args)
            self.vllm_pins = await pins
        except BaseException as exc:  # noqa: BLE001 - reported via /health and the exit code
            self.start_error = exc
            logger.exception("engine failed to start")
            raise
        freeze_startup_heap()
        self.startup_seconds = time.perf_counter() - began
        logger.info("engine ready in %.1f s (max_model_len=%d)", self.startup_seconds, self.max_model_len)
        self.ready.set()

    @property
    def healthy(self) -> bool:
        """True when the engine is up and its core has not died."""
        if not self.ready.is_set() or self.dead or self.engine is None:
            return False
        if getattr(self.engine, "errored", False):
            self.dead = True
            return False
        return True

    def batch_limits(self) -> dict[str, int] | None:
        """The running engine's scheduler limits (tokens, sequences), None before it is up."""
        config = getattr(self.engine, "vllm_config", None)
        if config is None:
            return None
        sched = config.scheduler_config
        return {"max_model_len": self.max_model_len, "max_num_seqs": int(sched.max_num_seqs),
                "max_num_batched_tokens": int(sched.max_num_batched_tokens)}

    def num_unfinished_requests(self) -> int:
        """Requests the engine still tracks (0 when idle)."""
        if self.engine is None:
            return 0
        # vLLM 0.32 has AsyncLLM.get_num_unfinished_requests; 0.26 only its output processor's.
        return int(self.engine.output_processor.get_num_unfinished_requests())

    def note_engine_failure(self, exc: BaseException) -> bool:
        """Mark the engine dead if `exc` (from a request) says its core died; True if so."""
        from moe_serve.service.vllm_compat import EngineDeadError

        if isinstance(exc, EngineDeadError) or getattr(self.engine, "errored", False):
            self.dead = True
        return self.dead

    async def set_worker_jit_phase(self, phase: str) -> None:
        """Tell every worker's plugin that Triton compiles from now on count as `phase` ('warmup'
        while the request warm-up runs, then 'serving'); a failure is logged, never raised."""
        from moe_serve.kernels.plugin.vllm_plugin import JIT_PHASE_RPC

        try:
            await self.engine.collective_rpc(JIT_PHASE_RPC, timeout=JIT_PHASE_RPC_TIMEOUT_S, args=(phase,))
        except Exception as exc:  # noqa: BLE001 - the phase labels metrics only
            logger.warning("could not set the workers' Triton JIT phase to %s: %r", phase, exc)

    async def abort_all(self) -> None:
        """Abort every running request; their streams end with finish_reason 'abort'."""
        if self.engine is not None and self.active:
            await self.engine.abort(list(self.active))

    def shutdown(self) -> None:
        """Stop the engine core and its workers; they get ENGINE_EXIT_GRACE_S to exit by themselves."""
        if self.engine is not None:
            logger.info("shutting down engine")
            began = time.perf_counter()
            self.engine.shutdown(timeout=ENGINE_EXIT_GRACE_S)
            self.engine = None
            logger.info("engine stopped in %.1f s", time.perf_counter() - began)


def check_vllm_pins() -> dict[str, Any]:
    """moe_serve.service.vllm_compat.pins_report(), logged: the vLLM version and whether moe-serve's pins on
    its internals hold (the failed pins named when not: a warning unless the plugin gave it)."""
    from moe_serve.service import vllm_compat

    try:
        report = vllm_compat.pins_report()
    except Exception as exc:  # noqa: BLE001 - a broken check must not stop serving
        report = {"version": vllm_compat.vllm.__version__, "checked_versions": [], "pins_hold": False,
                  "failed": {"pins_report": repr(exc)[:300]}}
    checked = ", ".join(report["checked_versions"]) or "?"
    if report["pins_hold"]:
        logger.info("vLLM %s: moe-serve's pins on its internals hold (checked for vLLM %s)",
                    report["version"], checked)
    else:
        from moe_serve.kernels.plugin.vllm_plugin import PINS_WARNED_ENV

        # Where this process's plugin already warned (optimized mode), once is enough.
        level = logging.INFO if os.environ.get(PINS_WARNED_ENV) else logging.WARNING
        logger.log(level, "vLLM %s: moe-serve's pins on its internals do not hold (checked for vLLM %s); vLLM's "
                   "MoE kernels serve: %s", report["version"], checked,
                   "; ".join(f"{name}: {error}" for name, error in report["failed"].items()))
    return report


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (torch, vLLM, tokenizer: ~650k on the CPU
    engine) out of the collector's reach. Unfrozen, full collections during serving scanned them
    all and paused the event loop 0.8-0.9 s (TTFT p99 at 32 streams: ~1 s).
    vLLM's engine core does the same for its own process (freeze_gc_heap)."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("froze %d startup objects out of the GC in %.2f s", gc.get_freeze_count(), time.perf_counter() - began)


PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "moe_serve_kernels"


def kernel_plugin_installed() -> bool:
    """vLLM loads plugins from installed entry points only; a source tree on PYTHONPATH has none."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=PLUGIN_GROUP))


RAY_ENV_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def default_engine_env(embedded_model: bool = False) -> None:
    """Environment defaults vLLM needs here (set only where the user has not)."""
    if embedded_model:
        # Named/required tool choice through vLLM's JSON-schema structured outputs (which honour
        # EMBEDDED_STRUCTURED_OUTPUTS) instead of xgrammar structural tags (which allow any
        # whitespace, where a random-weight model stays). Read when vLLM's tool parsers are imported.
        os.environ.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    # vLLM 0.26 on the H200 hung at engine start without spawn (seen 2026-11-29).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # Read by the engine core when it stops its workers (see WORKER_EXIT_GRACE_S).
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_EXIT_GRACE_S))
    # vLLM's legacy Ray executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0) copies only some env vars
    # to its workers: add ours (kernel mode, runtime dir); the V2 executor copies them all.
    prefixes = [p for p in os.environ.get(RAY_ENV_PREFIXES, "").split(",") if p]
    if "MOE_SERVE_" not in prefixes:
        os.environ[RAY_ENV_PREFIXES] = ",".join([*prefixes, "MOE_SERVE_"])
