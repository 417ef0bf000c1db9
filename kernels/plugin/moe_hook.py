"""The plugin's MoE hook: vLLM's TritonExperts.apply -> our fused_moe where we support the call
and the layer's plan (kernels/plugin/layer_plan.py, built at the layer's first call) routes its M
to ours, with the plan's config for that M.

Supported: gated SiLU, no expert_map / LoRA / bias / clamp, GEMM2 finished by TritonExperts' own
top-k sum (vllm_compat.custom_finish); bf16/fp16/fp32, or FP8 W8A8 in
the three formats of moe_serve.kernels.moe.quant_format: per-tensor or per-channel weight scales with a
per-tensor activation scale, or with dynamic per-token activations (FP8-dynamic), and block
scales ([bn, bk] weight blocks, activations per token per bk columns; bk a power of two >= 16:
it is the K loop's tile), read from the experts as vLLM's Triton experts read them
(vllm_compat.fp8_layout). Everything else, and
supported calls routed to vLLM, run vLLM's original (counted 'fallback' + reason, or
'routed_to_vllm'); so does every call of a layer whose plan fails closed (VLLM_BATCH_INVARIANT).
Every layer shape seen is queued for warm-up (kernels/plugin/layer_warmup.py).
Why this point: it owns the whole expert computation (both GEMMs, activation, routed-weight
reduction into ``output``: TritonExperts' finalize is a no-op) for every model and for both the
unquantized and FP8 paths, while prepare/finalize, routing and CUDA graphs stay vLLM's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from moe_serve.kernels.moe import routing
from moe_serve.kernels.moe.config_schema import Config
from moe_serve.kernels.moe.fused_moe import FP8, Fp8Scales, fused_moe
from moe_serve.kernels.plugin.layer_plan import LayerFacts, LayerPlan
from moe_serve.kernels.plugin.layer_warmup import LayerShape, LayerWarmup, VllmCallTemplate
from moe_serve.kernels.plugin.plugin_host import PluginHost
from moe_serve.kernels.plugin.vllm_compat import OUTPUT_WRITTEN, ApplyCall, call_apply, custom_finish, fp8_layout


def unsupported_reason(experts: Any, call: ApplyCall, require_cuda: bool = True,
                       experts_base: type | None = None) -> str | None:
    """None when our kernel can compute this call, else a short reason (for the metrics).
    experts_base: vLLM's TritonExperts, whose own GEMM2 finish ours replaces (vllm_compat.custom_finish)."""
    q = getattr(experts, "quant_config", None)
    x, w1, w2, out = call.hidden_states, call.w1, call.w2, call.output
    act = getattr(call.activation, "name", str(call.activation))
    if act.upper() != "SILU":
        return f"activation:{act}"
    if call.expert_map is not None:
        return "expert_map"
    if getattr(experts, "_lora_context", None) is not None:
        return "lora"
    if getattr(experts, "w1_bias", None) is not None or getattr(experts, "w2_bias", None) is not None:
        return "bias"
    if getattr(experts, "quantization_emulation", False):
        return "emulation"
    if any(getattr(q, a, None) is not None for a in ("gemm1_clamp_limit", "gemm1_alpha", "gemm1_beta")):
        return "swiglu_params"
    if require_cuda and not x.is_cuda:
        return "device"
    if x.dim() != 2 or not x.is_contiguous() or w1.dim() != 3 or w2.dim() != 3:
        return "layout"
    E = w1.size(0)
    if call.global_num_experts not in (-1, E):
        return "global_num_experts"
    if w1.size(1) != 2 * w2.size(2) or w1.size(2) != x.size(1):
        return "not_gated"
    if q is not None and getattr(q, "use_fp8_w8a8", False):
        return _fp8_reason(experts, call) or custom_finish(experts, call, experts_base)
    if q is not None and getattr(q, "quant_dtype", None) is not None:
        return f"quant:{q.quant_dtype}"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype:{x.dtype}"
    if not (x.dtype == w1.dtype == w2.dtype == out.dtype):
        return "mixed_dtypes"
    return custom_finish(experts, call, experts_base)


def _fp8_reason(experts: Any, call: ApplyCall) -> str | None:
    x, w1, w2 = call.hidden_states, call.w1, call.w2
    if w1.dtype != FP8 or w2.dtype != FP8 or call.output.dtype != torch.bfloat16:
        return "fp8_dtypes"
    if x.dtype not in (FP8, torch.bfloat16, torch.float16, torch.float32):
        return f"fp8_input:{x.dtype}"
    block, per_token = fp8_layout(experts)
    M, K = x.shape
    E, n = w1.size(0), w2.size(2)
    a1 = call.a1q_scale
    if block:
        bn, bk = block
        if bk < 16 or bk & (bk - 1) or bn < 1:
            return f"fp8_block_shape:{bn}x{bk}"
        for attr, rows, cols in (("w1_scale", 2 * n, K), ("w2_scale", w2.size(1), n)):
            s = getattr(experts, attr, None)
            if s is None or tuple(s.shape) != (E, -(-rows // bn), -(-cols // bk)):
                return "fp8_block_scale_layout"
        if x.dtype == FP8 and (a1 is None or tuple(a1.shape) != (M, -(-K // bk))):
            return "fp8_block_act_scale_layout"
        return "fp8_a2_scale_layout" if call.a2_scale is not None else None
    if per_token:
        if x.dtype == FP8 and (a1 is None or a1.numel() != M):
            return "fp8_act_scale_per_token_layout"
        if call.a2_scale is not None:
            return "fp8_a2_scale_layout"
    elif x.dtype == FP8 and (a1 is None or a1.numel() != 1):
        return "fp8_act_scale_per_token"             # per-token scales without the format flag
    a2 = getattr(experts, "a2_scale", None)
    if a2 is not None and a2.numel() != 1:
        return "fp8_a2_scale_layout"
    for attr, rows in (("w1_scale", 2 * n), ("w2_scale", w2.size(1))):
        s = getattr(experts, attr, None)
        if s is None or s.numel() not in (E, E * rows):
            return "fp8_w_scale_layout"
    return None


def fp8_scales(experts: Any, call: ApplyCall) -> Fp8Scales | None:
    """Our Fp8Scales for an FP8 W8A8 call (None for 16/32-bit weights)."""
    if call.w1.dtype != FP8:
        return None
    block, per_token = fp8_layout(experts)
    x_fp8 = call.hidden_states.dtype == FP8
    a1 = call.a1q_scale if x_fp8 else None if block or per_token else getattr(experts, "a1_scale", None)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731 - no copy when already fp32
    return Fp8Scales(f32(experts.w1_scale), f32(experts.w2_scale), f32(a1), f32(call.a2_scale),
                     block_shape=tuple(block) if block else None, per_token_act=per_token and not block)


def layer_shape(call: ApplyCall, scales: Fp8Scales | None) -> LayerShape:
    E, two_n, K = call.w1.shape
    fp8 = None
    if scales is not None:
        fp8 = "block" if scales.block_shape else "per_tensor" if scales.w1_scale.numel() == E else "per_channel"
    return LayerShape(E=E, N=two_n // 2, K=K, topk=call.topk_ids.size(1), dtype=call.hidden_states.dtype,
                      fp8=fp8, static_act=scales is not None and scales.a1_scale is not None
                      and not scales.per_token_act and not scales.block_shape,
                      router_on_input=call.apply_router_weight_on_input,
                      ids_dtype=call.topk_ids.dtype, device=str(call.hidden_states.device),
                      per_token_act=scales is not None and scales.per_token_act,
                      block_shape=scales.block_shape if scales is not None else None)


class MoeHook:
    """handle() is what the wrapped TritonExperts.apply does, for one plugin (its reporting) and
    its layer warm-up. require_cuda: our kernels run on CUDA tensors only."""

    require_cuda = True
    experts_base: type | None = None  # vLLM's TritonExperts, set when the hook is installed

    def __init__(self, plugin: PluginHost, layers: LayerWarmup) -> None:
        self.plugin = plugin
        self.layers = layers
        self._plans: dict[int, LayerPlan] = {}  # id(experts) -> its layer's plan (fixed per layer)

    def handle(self, orig: Callable, experts: Any, call: ApplyCall) -> Any:
        why = unsupported_reason(experts, call, self.require_cuda, self.experts_base)
        if why is not None:
            return self._fallback(orig, experts, call, why)
        try:
            scales = fp8_scales(experts, call)
            plan = self._plans.get(id(experts)) or self._plan(orig, experts, call, scales)
        except Exception as exc:  # noqa: BLE001
            return self._fallback(orig, experts, call, f"error:{type(exc).__name__}")
        if plan.reason_key is not None:                 # fail closed: the whole layer is vLLM's
            return self._fallback(orig, experts, call, plan.reason_key)
        M = call.hidden_states.size(0)
        if plan.route(M) != routing.OURS:
            self.plugin.count_launch("routed_to_vllm")
            return call_apply(orig, experts, call)
        try:
            self.run_ours(experts, call, scales, plan.config(M))
        except Exception as exc:  # noqa: BLE001 - serve with vLLM's kernel, say so loudly once
            key = f"error:{type(exc).__name__}"
            self.plugin.log_once(key, "moe-serve kernel failed, falling back to vLLM's: %r", exc)
            return self._fallback(orig, experts, call, key)
        self.plugin.count_launch("optimized")
        return OUTPUT_WRITTEN

    def _plan(self, orig: Callable, experts: Any, call: ApplyCall, scales: Fp8Scales | None) -> LayerPlan:
        """The layer's plan, at its first supported call; its shape queued for warm-up."""
        shape = layer_shape(call, scales)
        facts = LayerFacts(shape.E, shape.N, shape.K, shape.topk, shape.route_dtype,
                           act_bytes=call.hidden_states.element_size())
        plan = self._plans[id(experts)] = self.plugin.plan_for(facts, call.w1)
        self.layers.see(shape, plan, lambda: VllmCallTemplate.of(orig, experts, call))
        return plan

    def run_ours(self, experts: Any, call: ApplyCall, scales: Fp8Scales | None, config: Config | None) -> None:
        """Our fused MoE with the plan's config (None: selection's for M) into vLLM's `output`
        buffer (the final [M, K] sum)."""
        fused_moe(call.hidden_states, call.w1, call.w2, call.topk_weights, call.topk_ids, fp8=scales,
                  apply_router_weight_on_input=call.apply_router_weight_on_input, out=call.output,
                  config=config)

    def _fallback(self, orig: Callable, experts: Any, call: ApplyCall, why: str) -> Any:
        self.plugin.count_fallback(why)
        return call_apply(orig, experts, call)
