"""The pins: each checks that one vLLM internal kernels/plugin/vllm_compat.py relies on is where and
what it expects, on the vLLM of this process (the plugin runs them all before it patches anything,
`check_pins`; tests/test_vllm_compat.py runs them here on 0.32, bench/check_vllm_pins.py on a GPU
host). Each returns what it checked, or raises.

PATCHES lists every vLLM symbol the plugin replaces or adds, the pin that guards it and why no
supported extension point serves instead, checked in vLLM 0.26 and 0.32: ``CustomOp.register_oot``
replaces classes vLLM registers as custom ops, which are the MoE *methods*
(UnquantizedFusedMoEMethod, FusedMoEModularMethod), not the TritonExperts class below them that
serves both the unquantized and the FP8 formats (Fp8MoEMethod is no custom op): an OOT method
would cover bf16 only and the FP8 patch would stay; the routers' capture hook
(``BaseRouter.set_capture_fn``, both versions) sees every layer's logical top-k ids, which is what
the expert load counts (kernels/plugin/expert_load.py), and has one slot that vLLM's own
routed-experts capture also sets. Model classes are replaced through vLLM's ``ModelRegistry``
(kernels/models: the fused pieces, Mixtral's gate moved into its runner), not patched.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import re
from typing import Callable

import torch
import vllm
from vllm.config import KernelConfig, ParallelConfig, SchedulerConfig, VllmConfig

from moe_serve.kernels.moe import vllm_kernels as vk
from moe_serve.kernels.plugin.vllm_compat import (APPLY_PARAMS, APPLY_RETURNS, COMPUTE_ROUTING_PARAMS, DENSE_APPLY_PARAMS,
                                        DENSE_METHODS, EXPERTS, LAYER_UTILS, LOGITS_PROCESSOR,
                                        FORWARD_IMPL_PARAMS, GATED_BLOCKS, GPU_WORKER, MODULAR, MOE_RUNNER,
                                        ROUTER_BASE, ROUTER_FACTORY, ROUTERS, SCHEDULER_OUTPUT,
                                        SELECT_EXPERTS_PARAMS, SUPPORTED, UVA_MARK, WARMUP_METHOD, WORKER_BASE,
                                        fp8_layout, load, vllm_config_chooser, vllm_minor)


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


def pin_finish_points() -> str:
    """What custom_finish reads: where TritonExperts.apply finishes GEMM2 through other code than
    its own top-k sum (0.33), it does so only through the names custom_finish checks."""
    src = inspect.getsource(inspect.unwrap(load(EXPERTS).apply))
    names = set(re.findall(r"self\.(_uses_post_gemm2_hook|_run_post_gemm2_hook|_finalize_expert_output|"
                           r"_apply_router_weight_in_gemm2)\(", src))
    if vllm_minor() >= (0, 33):
        assert names == {"_uses_post_gemm2_hook", "_run_post_gemm2_hook", "_finalize_expert_output",
                         "_apply_router_weight_in_gemm2"}, names
        assert "post_gemm2_hook" in vars(load(MODULAR).__mro__[1]), "FusedMoEExperts.post_gemm2_hook"
        assert UVA_MARK in inspect.getsource(importlib.import_module(vk.FUSED_EXPERTS[0]))
    else:
        assert not names, names
    return "TritonExperts' GEMM2 finish (post_gemm2_hook, overridable finish, UVA weights)"


def pin_router() -> str:
    """What moe_serve.kernels.plugin.router_hook wraps and reads: the runner's entry point and the two
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
    """What moe_serve.kernels.plugin.expert_load wraps and reads: the routers' common entry (no router class
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
    """What moe_serve.kernels.models.runner_gate's gated_forward replaces: each gated block's forward computes the gate in
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


def pin_dense_linear() -> str:
    """What moe_serve.kernels.plugin.dense_hook wraps: both methods' apply(self, layer, x, bias) computes
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


# The attributes vLLM 0.26's and 0.32's routers set up (their __init__, the base classes'), each one
# read by router_spec (or an attribute of the plumbing around it: capture, EPLB, replay). A router
# attribute not in this set is a routing term router_spec has never seen: the pin fails, and vLLM's
# kernels serve (fail closed).
KNOWN_ROUTER_STATE = frozenset({
    "_routing_replay_out", "eplb_state", "capture_fn", "global_num_experts", "top_k", "renormalize",
    "scoring_func", "_hash_indices_table", "e_score_correction_bias", "num_fused_shared_experts",
    "routed_scaling_factor", "shared_expert_weight", "bias_vl", "image_sentinel_lo"})


def _init_state(cls: type) -> set[str]:
    """The self.X names cls.__init__ assigns."""
    src = inspect.getsource(inspect.unwrap(cls.__init__))
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", src))


def pin_router_terms() -> str:
    """Every routing term the routers our router hook serves can carry is one router_spec knows
    (vLLM 0.32 added bias_vl, which it refuses): a new one fails here, not silently in serving."""
    state: set[str] = set()
    for where in ROUTERS:
        for cls in load(where).__mro__:                       # the router and vLLM's bases of it
            if "__init__" in vars(cls) and cls.__module__.startswith("vllm."):
                state |= _init_state(cls)
    unknown = state - KNOWN_ROUTER_STATE
    assert not unknown, f"router attributes router_spec does not know: {sorted(unknown)}"
    return "FusedMoERouter/BaseRouter/FusedTopK(Bias)Router state: no routing term router_spec does not know"


def pin_config_fields() -> str:
    names = {f: set(getattr(c, "__dataclass_fields__", {})) for f, c in
             (("kernel", KernelConfig), ("parallel", ParallelConfig), ("scheduler", SchedulerConfig))}
    assert "moe_backend" in names["kernel"] and "tensor_parallel_size" in names["parallel"]
    assert {"max_num_batched_tokens", "max_num_seqs"} <= names["scheduler"]
    assert "additional_config" in VllmConfig.__dataclass_fields__      # the plugin's settings (kernels/config.py)
    return "KernelConfig.moe_backend, ParallelConfig/SchedulerConfig fields, VllmConfig.additional_config"


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
    """The vLLM pieces moe_serve.kernels.moe.vllm_kernels loads (it returns None where one is missing)."""
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


def pin_fp8_dense() -> str:
    """kernels/plugin/fp8_dense_pins.py's pins (vLLM's FP8 linear methods and their stored layouts),
    imported here only when the pins run."""
    from moe_serve.kernels.plugin import fp8_dense_pins

    return "; ".join(pin() for pin in fp8_dense_pins.PINS)


def _pin_flash_attention() -> str:
    """kernels/plugin/attention_hook.py's pin, checked when that hook installs (a failure there
    leaves vLLM's attention in place, not the whole plugin off)."""
    from moe_serve.kernels.plugin import attention_hook

    return attention_hook.pin_flash_attention()


PINS: tuple[Callable[[], str], ...] = (pin_version, pin_apply, pin_finish_points, pin_worker, pin_config_fields,
                                       pin_config_chooser, pin_workspace_views,
                                       pin_kernel_baselines, pin_fp8_layout, pin_router, pin_router_terms,
                                       pin_runner_gate, pin_expert_load, pin_dense_linear, pin_fp8_dense)
HOOK_PINS: tuple[Callable[[], str], ...] = (_pin_flash_attention,)   # checked by their hook as it installs
_FP8_LINEAR = "vllm.model_executor.layers.quantization.fp8:Fp8LinearMethod"
_CT_FP8 = ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8:"
           "CompressedTensorsW8A8Fp8")

# hook name (as MoePlugin.hooks lists it) -> (the vLLM symbol replaced or added, its pin, why a patch)
NO_OOT = "not a custom op: no register_oot point"
_NO_OOT_FP8 = NO_OOT + " (the FP8 linear methods are no custom ops)"
PATCHES: dict[str, tuple[str, Callable[[], str], str]] = {
    "WorkerBase.__init__": ("vllm.v1.worker.worker_base:WorkerBase.__init__", pin_worker,
                            "the worker's config, before the model is built: vLLM calls plugins before, not after"),
    "TritonExperts.apply": ("vllm.model_executor.layers.fused_moe.experts.triton_moe:TritonExperts.apply", pin_apply,
                            NO_OOT + " (its methods are; one per format, FP8's none)"),
    "MoERunner._forward_impl": ("vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._forward_impl",
                                pin_router, NO_OOT),
    "FusedTopKRouter._compute_routing": (
        "vllm.model_executor.layers.fused_moe.router.fused_topk_router:FusedTopKRouter._compute_routing", pin_router,
        NO_OOT),
    "FusedTopKBiasRouter._compute_routing": (
        "vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router:FusedTopKBiasRouter._compute_routing",
        pin_router, NO_OOT),
    "gate.forward": ("a MoE runner's gate module's forward (per instance)", pin_router, NO_OOT + " for a model's gate"),
    "UnquantizedLinearMethod.apply": ("vllm.model_executor.layers.linear:UnquantizedLinearMethod.apply",
                                      pin_dense_linear, NO_OOT + " (the linear layers are: one subclass per type)"),
    "UnquantizedEmbeddingMethod.apply": (
        "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply", pin_dense_linear,
        NO_OOT),
    "Worker.compile_or_warm_up_model": ("vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model", pin_worker,
                                        "no warm-up callback for plugins"),
    "FusedMoERouter.select_experts": (
        "vllm.model_executor.layers.fused_moe.router.fused_moe_router:FusedMoERouter.select_experts",
        pin_expert_load, "set_capture_fn has one slot, vLLM's routed-experts capture's (module doc)"),
    "Worker.load_model": ("vllm.v1.worker.gpu_worker:Worker.load_model", pin_expert_load,
                          "no after-load callback for plugins"),
    "Worker.execute_model": ("vllm.v1.worker.gpu_worker:Worker.execute_model", pin_expert_load,
                             "no per-step callback for plugins"),
    "Fp8LinearMethod.process_weights_after_loading": (f"{_FP8_LINEAR}.process_weights_after_loading", pin_fp8_dense,
                                                      _NO_OOT_FP8),
    "Fp8LinearMethod.apply": (f"{_FP8_LINEAR}.apply", pin_fp8_dense, _NO_OOT_FP8),
    "CompressedTensorsW8A8Fp8.process_weights_after_loading": (f"{_CT_FP8}.process_weights_after_loading",
                                                               pin_fp8_dense, _NO_OOT_FP8),
    "CompressedTensorsW8A8Fp8.apply_weights": (f"{_CT_FP8}.apply_weights", pin_fp8_dense, _NO_OOT_FP8),
    "FlashAttentionImpl.forward": ("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
                                   _pin_flash_attention, "a CUSTOM attention backend is chosen by the engine's "
                                   "attention_config, which a plugin cannot set under `vllm serve` (attention_hook.py)"),
}


class _DropDefaultMoEConfigWarning(logging.Filter):
    """vLLM's "Using default MoE config" warning for the pins' made-up shape: not about the model."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Using default MoE config")


def check_pins() -> dict[str, str]:
    """Run every pin on this process's vLLM: {pin name: error} of those that fail (empty: they all hold)."""
    failed: dict[str, str] = {}
    noisy = logging.getLogger("vllm.model_executor.layers.fused_moe.fused_moe")  # a pin's config lookup
    quiet = _DropDefaultMoEConfigWarning()
    noisy.addFilter(quiet)  # a filter, not a level: vLLM's logging set-up may reset levels meanwhile
    try:
        for pin in PINS:
            try:
                pin()
            except Exception as exc:  # noqa: BLE001 - every failing pin is reported
                failed[pin.__name__] = repr(exc)[:300]
    finally:
        noisy.removeFilter(quiet)
    return failed
