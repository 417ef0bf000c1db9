"""Where the plugin touches vLLM internals (vLLM 0.26 on the GPU host, 0.32 here, 0.33), and the pins of
the kernel-side pieces moe_serve.kernels.moe.vllm_kernels loads.

Every point below is checked by a pin (kernels/plugin/vllm_pins.py); tests/test_vllm_compat.py runs them on the CPU
(0.32), bench/check_vllm_pins.py on the GPU host (0.26). 0.33's were run on its wheel's source
without a GPU: ``pip download vllm==0.33.0 --no-deps``, its ``vllm/*.py`` unzipped into DIR, then
``VLLM_TARGET_DEVICE=cpu PYTHONPATH=DIR pytest tests/test_vllm_compat.py
tests/test_service_vllm_compat.py`` in this venv: all passed (2026-12-06). The plugin runs the pins
too (``vllm_pins.check_pins``) before it patches anything: where one fails it installs no kernel hook, and
vLLM's kernels serve. Where the versions differ, the difference is dispatched here on
``vllm_minor()``:

| point (vLLM module)                                   | 0.26            | 0.32                        | 0.33 |
|-------------------------------------------------------|-----------------|-----------------------------|------|
| ``TritonExperts.apply`` (fused_moe/experts/triton_moe) | APPLY_PARAMS    | APPLY_PARAMS                | same |
| ``FusedMoEExpertsModular.apply`` return               | None            | None or UnfinalizedMoEOutput | same |
| the experts' own GEMM2 finish (FINISH_POINTS)         | absent          | absent                      | post_gemm2_hook, overridable |
| ``WorkerBase.__init__(vllm_config, local_rank, rank)`` | same            | same                        | same |
| ``<Worker>.compile_or_warm_up_model(self)``           | same            | same                        | same |
| ``try_get_optimal_moe_config(w1, w2, top_k, dtype, M, block_shape)`` | same | same          | same |
| ``_resize_cache(flat, shape)`` views a workspace's front | same         | same                        | same |
| ``moe_align_block_size(topk_ids, block_size, E)``      | same            | same                        | same |
| ``fused_experts(x, w1, w2, tw, ids, quant_config=)``   | same            | same                        | same |
| ``fp8_w8a8_moe_quant_config(w1_scale=, w2_scale=, a1_scale=, a2_scale=)`` | same | same | same |
| ``fp8_w8a8_moe_quant_config(..., per_act_token_quant=, block_shape=)`` | same  | same                        | same |
| ``FusedMoEExperts.block_shape`` / ``.per_act_token_quant`` (its quant_config's) | same | same | same |
| VllmConfig fields read by ``worker_facts``            | same            | same                        | same |
| ``MixtralMoE`` computes its gate, then ``self.experts(h, logits)`` (models/mixtral) | same | same | same |
| ``FusedMoERouter.select_experts(self, hidden_states, router_logits, topk_indices_dtype, *, input_ids)`` | same | same | same |
| MoE runners in ``compilation_config.static_all_moe_layers`` / ``static_forward_context``, ``.router`` | same | same | same |
| ``Worker.load_model(self, *, load_dummy_weights)``, ``.execute_model(self, scheduler_output)``, ``.device`` | same | same | same |
| ``SchedulerOutput.total_num_scheduled_tokens``                | same            | same                        | same |
| ``Unquantized{Linear,Embedding}Method.apply(self, layer, x, bias)`` -> F.linear on CUDA | per call | Linear: ``_gemm_impl`` | same |

The return of apply: our kernel writes the final [M, K] sum into ``output`` and returns
``OUTPUT_WRITTEN`` (None), which both versions read as "output is final" (0.32 also accepts an
UnfinalizedMoEOutput, which TritonExperts never returns). vLLM's own results pass through
unchanged. ``FusedMoE`` (0.26) is ``FusedMoEFactory`` in 0.32; the plugin never names that
layer (it hooks the experts class below it), so nothing dispatches on it. 0.33's TritonExperts
lets a model finish GEMM2's rows its own way (a ``post_gemm2_hook``, or a subclass overriding a
FINISH_POINTS method) and reads UVA-offloaded weights from host memory: ``custom_finish`` names
such a call, which the hook leaves to vLLM.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import vllm

from moe_serve.kernels.moe import vllm_kernels as vk

EXPERTS = ("vllm.model_executor.layers.fused_moe.experts.triton_moe", "TritonExperts")
MODULAR = ("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEExpertsModular")
WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")
MOE_RUNNER = ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner")
GATED_BLOCKS = (("vllm.model_executor.models.mixtral", "MixtralMoE"),)   # MoE blocks computing their gate
ROUTERS = (("vllm.model_executor.layers.fused_moe.router.fused_topk_router", "FusedTopKRouter"),
           ("vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router", "FusedTopKBiasRouter"))
FORWARD_IMPL_PARAMS = ("self", "hidden_states", "router_logits", "shared_experts_input", "input_ids")
COMPUTE_ROUTING_PARAMS = ("self", "hidden_states", "router_logits", "indices_type", "input_ids")
GPU_WORKER = ("vllm.v1.worker.gpu_worker", "Worker")
ROUTER_BASE = ("vllm.model_executor.layers.fused_moe.router.fused_moe_router", "FusedMoERouter")
SELECT_EXPERTS_PARAMS = ("self", "hidden_states", "router_logits", "topk_indices_dtype", "input_ids")
ROUTER_FACTORY = "vllm.model_executor.layers.fused_moe.router.router_factory"
SCHEDULER_OUTPUT = ("vllm.v1.core.sched.output", "SchedulerOutput")
WARMUP_METHOD = "compile_or_warm_up_model"
DENSE_METHODS = (("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
                 ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"))
DENSE_APPLY_PARAMS = ("self", "layer", "x", "bias")
LAYER_UTILS = "vllm.model_executor.layers.utils"
LOGITS_PROCESSOR = "vllm.model_executor.layers.logits_processor"
APPLY_PARAMS = ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
                "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
                "workspace13", "workspace2", "expert_tokens_meta", "apply_router_weight_on_input")
SUPPORTED = ((0, 26), (0, 32), (0, 33))
OUTPUT_WRITTEN = None
APPLY_RETURNS = {(0, 26): "None", (0, 32): "UnfinalizedMoEOutput | None", (0, 33): "UnfinalizedMoEOutput | None"}
# TritonExperts methods through which vLLM 0.33 lets a subclass finish GEMM2's rows its own way
FINISH_POINTS = ("_finalize_expert_output", "_apply_router_weight_in_gemm2", "finalize_weight_and_reduce_impl")
UVA_MARK = "_vllm_is_uva_offloaded"  # vLLM 0.33: a weight read from host memory in place
MARK = "__moe_serve__"


def vllm_minor() -> tuple[int, int]:
    """(major, minor) of the running vLLM, e.g. (0, 32)."""
    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def load(where: tuple[str, str]) -> Any:
    """The object `name` of module `mod` for where = (mod, name)."""
    return getattr(importlib.import_module(where[0]), where[1])


def wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace cls.name by make(original) once (marked; the original stays as __wrapped__).
    False when it was already wrapped or cls has no such method."""
    orig = getattr(cls, name, None)
    if orig is None or getattr(orig, MARK, False):
        return False
    wrapper = functools.wraps(orig)(make(orig))
    setattr(wrapper, MARK, True)
    setattr(cls, name, wrapper)
    return True


@dataclass(slots=True)
class ApplyCall:
    """The arguments of one FusedMoEExpertsModular.apply call (APPLY_PARAMS without self)."""

    output: Any
    hidden_states: Any
    w1: Any
    w2: Any
    topk_weights: Any
    topk_ids: Any
    activation: Any
    global_num_experts: int
    expert_map: Any
    a1q_scale: Any
    a2_scale: Any
    workspace13: Any
    workspace2: Any
    expert_tokens_meta: Any
    apply_router_weight_on_input: bool

    def kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in APPLY_PARAMS[1:]}


Handler = Callable[[Callable, Any, ApplyCall], Any]


def apply_wrapper(handler: Handler) -> Callable[[Callable], Callable]:
    """make() for wrap_method on an experts class: the wrapper takes apply's parameters (keyword
    or positional) and returns handler(original, experts, call)."""
    def make(orig: Callable) -> Callable:
        def apply(self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any,
                  topk_ids: Any, activation: Any, global_num_experts: int, expert_map: Any,
                  a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
                  expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> Any:
            return handler(orig, self, ApplyCall(
                output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                expert_tokens_meta, apply_router_weight_on_input))
        return apply
    return make


def custom_finish(experts: Any, call: ApplyCall, base: type | None) -> str | None:
    """A reason when this call finishes GEMM2 other than `base`'s (TritonExperts') own top-k sum
    (vLLM 0.33: a post_gemm2_hook, or a subclass overriding a FINISH_POINTS method) or reads
    host-resident weights; None otherwise (always on 0.26 and 0.32). Runs per MoE call: no import."""
    if getattr(experts, "post_gemm2_hook", None) is not None:
        return "post_gemm2_hook"
    cls = type(experts)
    if base is not None and cls is not base and isinstance(experts, base):
        for name in FINISH_POINTS:
            if getattr(cls, name, None) is not getattr(base, name, None):
                return f"custom_finish:{name}"
    if any(getattr(w, UVA_MARK, False) for w in (call.w1, call.w2)):
        return "host_resident_weights"
    return None


def call_apply(orig: Callable, experts: Any, call: ApplyCall) -> Any:
    """vLLM's original apply with every argument by keyword; its result unchanged."""
    return orig(experts, **call.kwargs())


@dataclass(frozen=True)
class WorkerFacts:
    """What the plugin reads from a vLLM worker and its VllmConfig."""

    rank: int | None
    local_rank: int | None
    worker_class: str
    max_num_batched_tokens: int | None  # largest M a MoE layer sees (prefill chunk)
    max_num_seqs: int | None            # largest decode batch
    backend: str                        # kernel_config.moe_backend ('auto' when unset)
    dtype: str                          # quantization name, else the activation dtype (bf16, ...)
    activation_dtype: str
    tp_size: int | None


def worker_facts(worker: Any) -> WorkerFacts:
    cfg = getattr(worker, "vllm_config", None)
    model = getattr(cfg, "model_config", None)
    sched = getattr(cfg, "scheduler_config", None)
    quant = getattr(model, "quantization", None)
    dt = str(getattr(model, "dtype", "unknown")).replace("torch.", "")
    dt = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dt, dt)
    cls = type(worker)
    return WorkerFacts(
        rank=getattr(worker, "rank", None), local_rank=getattr(worker, "local_rank", None),
        worker_class=f"{cls.__module__}.{cls.__qualname__}",
        max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None),
        max_num_seqs=getattr(sched, "max_num_seqs", None),
        backend=str(getattr(getattr(cfg, "kernel_config", None), "moe_backend", None) or "auto"),
        dtype=str(quant) if quant else dt, activation_dtype=dt,
        tp_size=getattr(getattr(cfg, "parallel_config", None), "tensor_parallel_size", None))


def additional_config(worker: Any) -> Mapping[str, Any] | None:
    """The worker's vllm_config.additional_config where it is a dict (vLLM also takes an object
    with compute_hash, which holds no moe-serve settings), else None."""
    extra = getattr(getattr(worker, "vllm_config", None), "additional_config", None)
    return extra if isinstance(extra, Mapping) else None


def experts_weight(runner: Any) -> Any:
    """A MoE runner's expert weight w13 [E, 2N, K] (what its experts' apply gets as w1), or None
    where the runner has none in vLLM's RoutedExperts."""
    return getattr(getattr(runner, "routed_experts", None), "w13_weight", None)


def moe_routers(vllm_config: Any) -> list[tuple[str, Any]]:
    """(layer name, router) of every MoE runner of the loaded model, in the model's order: the
    runners vLLM registers for its MoE op in the compilation config."""
    cc = vllm_config.compilation_config
    runners = ((name, cc.static_forward_context.get(name)) for name in cc.static_all_moe_layers)
    return [(name, r.router) for name, r in runners if getattr(r, "router", None) is not None]


def fp8_layout(experts: Any) -> tuple[list[int] | None, bool]:
    """(block_shape, per_act_token_quant) of an FP8 experts object, as vLLM's Triton experts
    read them (FusedMoEExperts properties over its quant_config)."""
    return experts.block_shape, bool(experts.per_act_token_quant)


def vllm_config_chooser(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...], topk: int,
                        fmt: str) -> Callable[[int], str]:
    """M -> vLLM's own fused-MoE config for this layer of format `fmt` (a quant_format key;
    try_get_optimal_moe_config), as a hashable string; cached. Raises when vLLM cannot choose
    (no GPU config machinery)."""
    try_get_optimal_moe_config = load(vk.CONFIG_LOOKUP)
    dtype, block = vk.vllm_dtype(fmt)

    @functools.lru_cache(maxsize=None)
    def choose(M: int) -> str:
        return repr(sorted(try_get_optimal_moe_config(w1_shape, w2_shape, topk, dtype, M,
                                                      block_shape=block).items()))

    choose(1)
    return choose


def default_dense_gemm() -> Callable[[Any], bool]:
    """method -> whether vLLM's apply of this unquantized linear / embedding method is F.linear
    on CUDA: always in 0.26 (dispatch_unquantized_gemm() per call); in 0.32 unless the method's
    ``_gemm_impl``, chosen at construction from kernel_config.linear_backend, is another
    (FlashInfer's bf16 GEMM, the CPU or ROCm ones). The check reads one attribute: traceable."""
    default = load((LAYER_UTILS, "default_unquantized_gemm"))

    def is_default(method: Any) -> bool:
        impl = getattr(method, "_gemm_impl", None)
        return impl is None or impl is default
    return is_default


def batch_invariant() -> bool:
    """vLLM's VLLM_BATCH_INVARIANT (its unquantized applies then run a batch-invariant GEMM)."""
    return bool(importlib.import_module("vllm.envs").VLLM_BATCH_INVARIANT)
