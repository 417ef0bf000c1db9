"""The plugin's MoE hook: vLLM's TritonExperts.apply -> our fused_moe where it is supported
and the measured routing table (kernels/routing.py) says ours is faster for (E, N, K, dtype, M).

Same path and signature of TritonExperts.apply in vLLM 0.26 and 0.32. Supported: gated SiLU,
no expert_map / LoRA / bias / clamp; bf16/fp16/fp32, or FP8 W8A8 with per-tensor or per-channel
weight scales and a per-tensor activation scale. Everything else, and supported calls routed to
vLLM, run vLLM's original (counted 'fallback' + reason, or 'routed_to_vllm'). Every shape seen
is queued for warm-up (kernels.plugin_warmup). Env MOE_SERVE_MOE_ROUTING=table|ours|vllm.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from kernels.plugin_state import (hooks, log_once, logger, pending_shapes, report, route_dtype, vllm_ctx,
                                  warmed_shapes)

EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.triton_moe"
EXPERTS_CLASS = "TritonExperts"
APPLY_PARAMS = ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
                "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
                "workspace13", "workspace2", "expert_tokens_meta", "apply_router_weight_on_input")


def install_moe_hook() -> None:
    """Wrap TritonExperts.apply (idempotent)."""
    cls = getattr(importlib.import_module(EXPERTS_MODULE), EXPERTS_CLASS)
    orig = cls.apply
    if getattr(orig, "__moe_serve__", False):
        return
    cls.apply = make_apply(orig)
    hooks.append(f"{EXPERTS_CLASS}.apply")


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
            log_once(key, "moe-serve kernel failed, falling back to vLLM's: %r", exc)
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
    if key not in vllm_ctx:
        M = max(1, hidden_states.size(0))
        vllm_ctx[key] = {
            "orig": orig, "experts": experts, "w1": w1, "w2": w2, "activation": activation,
            "global_num_experts": global_num_experts, "a1q_scale": a1q_scale,
            "a2_scale": a2_scale, "router_on_input": router_on_input,
            "hidden_dtype": hidden_states.dtype, "out_dtype": output.dtype,
            "ids_dtype": topk_ids.dtype, "tw_dtype": topk_weights.dtype, "topk": topk_ids.size(1),
            "ws13_dtype": workspace13.dtype, "ws2_dtype": workspace2.dtype,
            "ws13_per_row": -(-workspace13.numel() // M), "ws2_per_row": -(-workspace2.numel() // M)}
    if key not in warmed_shapes and key not in pending_shapes:
        pending_shapes[key] = shape
        from kernels import jit_monitor

        if jit_monitor.phase() == "serving" and not torch.cuda.is_current_stream_capturing():
            logger.warning("moe-serve: MoE shape first seen while serving, warming it up now: %s", shape)
            from kernels.plugin_warmup import warm_pending

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
