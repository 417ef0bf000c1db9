"""Where the plugin touches vLLM internals (vLLM 0.26 on the GPU host, 0.32 here), and the pins of
the kernel-side pieces kernels.moe.vllm_kernels loads.

Every point below is checked by a pin in ``PINS``; tests/test_vllm_compat.py runs them on the CPU
(0.32), bench/check_vllm_pins.py on the GPU host (0.26). Where the versions differ, the
difference is dispatched here on ``vllm_minor()``:

| point (vLLM module)                                   | 0.26            | 0.32                        |
|-------------------------------------------------------|-----------------|-----------------------------|
| ``TritonExperts.apply`` (fused_moe/experts/triton_moe) | APPLY_PARAMS    | APPLY_PARAMS                |
| ``FusedMoEExpertsModular.apply`` return               | None            | None or UnfinalizedMoEOutput |
| ``WorkerBase.__init__(vllm_config, local_rank, rank)`` | same            | same                        |
| ``<Worker>.compile_or_warm_up_model(self)``           | same            | same                        |
| ``try_get_optimal_moe_config(w1, w2, top_k, dtype, M, block_shape)`` | same | same          |
| ``_resize_cache(flat, shape)`` views a workspace's front | same         | same                        |
| ``moe_align_block_size(topk_ids, block_size, E)``      | same            | same                        |
| ``fused_experts(x, w1, w2, tw, ids, quant_config=)``   | same            | same                        |
| ``fp8_w8a8_moe_quant_config(w1_scale=, w2_scale=, a1_scale=, a2_scale=)`` | same | same |
| ``fp8_w8a8_moe_quant_config(..., per_act_token_quant=, block_shape=)`` | same  | same                        |
| ``FusedMoEExperts.block_shape`` / ``.per_act_token_quant`` (its quant_config's) | same | same |
| VllmConfig fields read by ``worker_facts``            | same            | same                        |
| ``MixtralMoE`` computes its gate, then ``self.experts(h, logits)`` (models/mixtral) | same | same |
| ``FusedMoERouter.select_experts(self, hidden_states, router_logits, topk_indices_dtype, *, input_ids)`` | same | same |
| MoE runners in ``compilation_config.static_all_moe_layers`` / ``static_forward_context``, ``.router`` | same | same |
| ``Worker.load_model(self, *, load_dummy_weights)``, ``.execute_model(self, scheduler_output)``, ``.device`` | same | same |
| ``SchedulerOutput.total_num_scheduled_tokens``                | same            | same                        |
| ``Unquantized{Linear,Embedding}Method.apply(self, layer, x, bias)`` -> F.linear on CUDA | per call | Linear: ``_gemm_impl`` |

The return of apply: our kernel writes the final [M, K] sum into ``output`` and returns
``OUTPUT_WRITTEN`` (None), which both versions read as "output is final" (0.32 also accepts an
UnfinalizedMoEOutput, which TritonExperts never returns). vLLM's own results pass through
unchanged. ``FusedMoE`` (0.26) is ``FusedMoEFactory`` in 0.32; the plugin never names that
layer (it hooks the experts class below it), so nothing dispatches on it.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import vllm
from vllm.config import KernelConfig, ParallelConfig, SchedulerConfig

from kernels.moe import vllm_kernels as vk

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
SUPPORTED = ((0, 26), (0, 32))
OUTPUT_WRITTEN = None
APPLY_RETURNS = {(0, 26): "None", (0, 32): "UnfinalizedMoEOutput | None"}
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


def _params(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


def pin_version() -> str:
    assert vllm_minor() in SUPPORTED, f"vLLM {vllm.__version__}: pins are checked for {SUPPORTED}"
    return vllm.__version__


def pin_apply() -> str:
    assert _params(load(EXPERTS).apply) == APPLY_PARAMS
    assert _params(load(MODULAR).apply) == APPLY_PARAMS
    ret = inspect.signature(inspect.unwrap(load(MODULAR).apply)).return_annotation
    assert re.sub(r"[\w.]+\.(\w+)", r"\1", str(ret)) == APPLY_RETURNS[vllm_minor()], ret
    impl = load(EXPERTS).finalize_weight_and_reduce_impl
    assert impl.__qualname__.startswith("TritonExperts"), impl  # NoOP: output is the final sum
    return "TritonExperts.apply parameters and return"


def pin_router() -> str:
    """What kernels.plugin.router_hook wraps and reads: the runner's entry point and the two
    routers' routing step, with the attributes router_spec reads."""
    assert _params(load(MOE_RUNNER)._forward_impl) == FORWARD_IMPL_PARAMS
    src = inspect.getsource(inspect.unwrap(load(MOE_RUNNER)._forward_impl))
    assert "self.gate(hidden_states)" in src, "the runner no longer calls its gate that way"
    for where in ROUTERS:
        cls = load(where)
        assert _params(cls._compute_routing) == COMPUTE_ROUTING_PARAMS, where
        init = set(_params(cls.__init__))
        assert {"top_k", "global_num_experts", "renormalize"} <= init, where
    assert {"e_score_correction_bias", "routed_scaling_factor", "hash_indices_table",
            "num_fused_shared_experts"} <= set(_params(load(ROUTERS[1]).__init__))
    return "MoERunner._forward_impl, FusedTopKRouter/FusedTopKBiasRouter._compute_routing"


def pin_expert_load() -> str:
    """What kernels.plugin.expert_load wraps and reads: the routers' common entry (no router class
    of vLLM's overrides it), the runners' registration and the worker's per-step entry."""
    base = load(ROUTER_BASE)
    assert _params(base.select_experts) == SELECT_EXPERTS_PARAMS
    src = inspect.getsource(inspect.unwrap(base.select_experts))
    assert "self._select_experts(" in src, "select_experts no longer returns the routing it computes"
    importlib.import_module(ROUTER_FACTORY)                      # every router class vLLM builds
    pending, seen = [base], []
    while pending:
        seen.append(cls := pending.pop())
        pending.extend(cls.__subclasses__())
    assert len(seen) > len(ROUTERS) and not [c for c in seen[1:] if "select_experts" in vars(c)], seen
    runner = load(MOE_RUNNER)
    init = inspect.getsource(inspect.unwrap(runner.__init__))
    assert "self.router = router" in init and "register_layer_for_moe_forward_op(" in init
    register = inspect.getsource(importlib.import_module(MOE_RUNNER[0]).register_layer_for_moe_forward_op)
    assert "static_forward_context[prefix] = layer" in register and "static_all_moe_layers.append(prefix)" in register
    worker = load(GPU_WORKER)
    assert _params(worker.load_model) == ("self", "load_dummy_weights")
    assert _params(worker.execute_model) == ("self", "scheduler_output")
    assert "self.device = torch.device(" in inspect.getsource(inspect.unwrap(worker.init_device))
    assert "total_num_scheduled_tokens" in load(SCHEDULER_OUTPUT).__dataclass_fields__
    return "FusedMoERouter.select_experts, MoE runner registration, Worker.load_model/execute_model"


def pin_runner_gate() -> str:
    """What kernels.plugin.runner_gate replaces: each gated block's forward computes the gate in
    the block and hands the logits to its runner, exactly as the replacement assumes, and its
    __init__ registers the gate before the runner (so the gate keeps its checkpoint name)."""
    for where in GATED_BLOCKS:
        cls = load(where)
        src = inspect.getsource(inspect.unwrap(cls.forward))
        for line in ("hidden_states = hidden_states.view(-1, self.hidden_size)",
                     "router_logits, _ = self.gate(hidden_states)", "self.experts(hidden_states, router_logits)",
                     ".view(orig_shape)"):
            assert line in src, (where, line)
        init = inspect.getsource(inspect.unwrap(cls.__init__))
        assert init.index("self.gate =") < init.index("self.experts ="), where
    return ", ".join(f"{where[1]}.forward / __init__" for where in GATED_BLOCKS)


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


def pin_dense_linear() -> str:
    """What kernels.plugin.dense_hook wraps: both methods' apply(self, layer, x, bias) computes
    the GEMM of layer.weight and bias (or, with VLLM_BATCH_INVARIANT, the batch-invariant one),
    whose CUDA default is F.linear; the logits processor runs the lm_head through its method's
    apply. Read on 0.26.0 (wheel source): the same lines, with dispatch_unquantized_gemm() per
    call where 0.32 keeps self._gemm_impl."""
    for where in DENSE_METHODS:
        apply = load(where).apply
        assert _params(apply) == DENSE_APPLY_PARAMS, where
        src = inspect.getsource(inspect.unwrap(apply))
        assert "layer.weight, bias)" in src and "VLLM_BATCH_INVARIANT" in src and src.count("return ") == 2, where
    gemm = inspect.getsource(load((LAYER_UTILS, "default_unquantized_gemm")))
    assert "torch.nn.functional.linear(x, weight, bias)" in gemm
    assert "return default_unquantized_gemm" in inspect.getsource(load((LAYER_UTILS, "dispatch_unquantized_gemm")))
    assert "lm_head.quant_method.apply(" in inspect.getsource(importlib.import_module(LOGITS_PROCESSOR))
    assert isinstance(importlib.import_module("vllm.envs").VLLM_BATCH_INVARIANT, bool)
    return "UnquantizedLinearMethod/UnquantizedEmbeddingMethod.apply, default_unquantized_gemm, lm_head"


def pin_worker() -> str:
    base = load(WORKER_BASE)
    assert {"vllm_config", "local_rank", "rank"} <= set(_params(base.__init__))
    assert callable(getattr(base, WARMUP_METHOD))
    assert _params(getattr(load(GPU_WORKER), WARMUP_METHOD)) == ("self",)
    return "WorkerBase.__init__, Worker.compile_or_warm_up_model"


def pin_config_fields() -> str:
    names = {f: set(getattr(c, "__dataclass_fields__", {})) for f, c in
             (("kernel", KernelConfig), ("parallel", ParallelConfig), ("scheduler", SchedulerConfig))}
    assert "moe_backend" in names["kernel"] and "tensor_parallel_size" in names["parallel"]
    assert {"max_num_batched_tokens", "max_num_seqs"} <= names["scheduler"]
    return "KernelConfig.moe_backend, ParallelConfig/SchedulerConfig fields"


def pin_config_chooser() -> str:
    assert _params(load(vk.CONFIG_LOOKUP))[:6] == ("w1_shape", "w2_shape", "top_k", "dtype", "M",
                                                  "block_shape")
    assert "BLOCK_SIZE_M" in vllm_config_chooser((8, 64, 32), (8, 32, 32), 2, "bf16")(5)
    return "try_get_optimal_moe_config"


def pin_workspace_views() -> str:
    from vllm.model_executor.layers.fused_moe.utils import _resize_cache

    flat = torch.arange(100.0)
    view = _resize_cache(flat, (3, 4))
    assert view.shape == (3, 4) and view.data_ptr() == flat.data_ptr()
    return "_resize_cache views a flat workspace from its start"


def pin_kernel_baselines() -> str:
    """The vLLM pieces kernels.moe.vllm_kernels loads (it returns None where one is missing)."""
    assert _params(load(vk.ALIGN_OP))[:3] == ("topk_ids", "block_size", "num_experts")
    fx, qcfg = load(vk.FUSED_EXPERTS), load(vk.FP8_QUANT_CONFIG)
    assert _params(fx)[:5] == ("hidden_states", "w1", "w2", "topk_weights", "topk_ids")
    assert "quant_config" in _params(fx)
    assert {"w1_scale", "w2_scale", "a1_scale", "a2_scale", "per_act_token_quant",
            "block_shape"} <= set(_params(qcfg))
    assert "BLOCK_SIZE_N" in (vk.moe_config(4, 8, 32, 64, 2, "bf16") or {"BLOCK_SIZE_N": 0})
    return "moe_align_block_size, fused_experts, fp8_w8a8_moe_quant_config"


def pin_fp8_layout() -> str:
    """What fp8_layout reads: the experts' properties over their quant_config, for a block and
    a per-token FP8 config built by vLLM's own constructor."""
    qcfg = load(vk.FP8_QUANT_CONFIG)
    experts = load(MODULAR).__mro__[1]                 # FusedMoEExperts
    for name in ("block_shape", "per_act_token_quant", "w1_scale", "w2_scale", "a1_scale", "a2_scale"):
        assert isinstance(getattr(experts, name), property), name
    one = torch.ones(2, 2, 2)
    block = qcfg(w1_scale=one, w2_scale=one, block_shape=[128, 128])
    token = qcfg(w1_scale=one, w2_scale=one, per_act_token_quant=True, per_out_ch_quant=True)
    view = lambda q: type("X", (), {"quant_config": q, "block_shape": experts.block_shape,  # noqa: E731
                                    "per_act_token_quant": experts.per_act_token_quant})()
    assert fp8_layout(view(block)) == ([128, 128], False), fp8_layout(view(block))
    assert fp8_layout(view(token)) == (None, True), fp8_layout(view(token))
    assert block.use_fp8_w8a8 and token.use_fp8_w8a8
    return "FusedMoEExperts.block_shape / per_act_token_quant, fp8 quant config block and per-token"


PINS: tuple[Callable[[], str], ...] = (pin_version, pin_apply, pin_worker, pin_config_fields,
                                       pin_config_chooser, pin_workspace_views,
                                       pin_kernel_baselines, pin_fp8_layout, pin_router, pin_runner_gate,
                                       pin_expert_load, pin_dense_linear)
