"""The plugin's per-layer warm-up: for every MoE layer shape a worker has seen, compile before
serving every kernel variant serving can hit, ours and vLLM's.

Ours: moe_serve.kernels.moe.moe_variants.warm_moe_variants (all M buckets up to max_num_batched_tokens) when
the layer's plan (kernels/plugin/layer_plan.py) sends any M of the shape to ours. vLLM's: its
original TritonExperts.apply, with the layer's real weights and quant config, at every decode M
(1..max_num_seqs) and one M per specialization class of vLLM's kernel up to
max_num_batched_tokens (warmup_plan) that the plan routes to vLLM. The setting
vllm_warmup_max_calls (kernels/config.py) caps vLLM calls per shape (4096).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_serve.kernels.config import current
from moe_serve.kernels.moe import quant_format, routing
from moe_serve.kernels.moe.fused_moe import dtype_name
from moe_serve.kernels.moe.moe_variants import warm_moe_variants
from moe_serve.kernels.plugin.layer_plan import LayerPlan
from moe_serve.kernels.plugin.plugin_host import PluginHost
from moe_serve.kernels.plugin.vllm_compat import ApplyCall, call_apply, vllm_config_chooser

DEFAULT_MAX_TOKENS, DEFAULT_MAX_SEQS = 8192, 256  # when the worker's scheduler config is unknown


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's problem as our kernels see it (per TP rank)."""

    E: int
    N: int                      # intermediate size per rank (w1 is [E, 2N, K])
    K: int                      # hidden size
    topk: int
    dtype: torch.dtype          # activation dtype (fp8 when vLLM quantized the hidden states)
    fp8: str | None             # None | 'per_tensor' | 'per_channel' | 'block' (W8A8 weight scales)
    static_act: bool            # FP8 activation scale static (else dynamic)
    router_on_input: bool
    ids_dtype: torch.dtype
    device: str
    per_token_act: bool = False                 # dynamic per-token activations (FP8-dynamic)
    block_shape: tuple[int, int] | None = None  # block FP8: (bn, bk)

    @property
    def route_dtype(self) -> str:
        """Routing/config key: the FP8 format's (moe_serve.kernels.moe.quant_format), else the activation
        dtype's."""
        if self.block_shape:
            return quant_format.block_key(*self.block_shape)
        if self.per_token_act:
            return quant_format.PER_TOKEN
        return quant_format.FP8 if self.fp8 else dtype_name(self.dtype)


@dataclass(frozen=True)
class VllmCallTemplate:
    """What a call of vLLM's original apply at another M needs: the layer and per-row sizes."""

    orig: Callable
    experts: Any
    call: ApplyCall             # the first call seen (weights, activation, scales, dtypes)
    ws13_per_row: int           # flat workspace elements per token
    ws2_per_row: int

    @classmethod
    def of(cls, orig: Callable, experts: Any, call: ApplyCall) -> "VllmCallTemplate":
        M = max(1, call.hidden_states.size(0))
        return cls(orig, experts, call, -(-call.workspace13.numel() // M), -(-call.workspace2.numel() // M))

    def call_at(self, M: int) -> ApplyCall:
        """Random hidden states, distinct experts per row spread over all experts, fresh
        workspaces (flat, as vLLM's _resize_cache views them)."""
        c, dev = self.call, self.call.w1.device
        E, K, topk = c.w1.size(0), c.w1.size(2), c.topk_ids.size(1)
        x = torch.randn(M, K, device=dev).to(c.hidden_states.dtype)
        ids = (torch.arange(M * topk, device=dev) % E).reshape(M, topk).to(c.topk_ids.dtype)
        tw = torch.full((M, topk), 1.0 / topk, device=dev, dtype=c.topk_weights.dtype)
        return ApplyCall(torch.empty(M, K, device=dev, dtype=c.output.dtype), x, c.w1, c.w2, tw, ids,
                         c.activation, c.global_num_experts, None, c.a1q_scale, c.a2_scale,
                         torch.empty((M + 1) * self.ws13_per_row, device=dev, dtype=c.workspace13.dtype),
                         torch.empty((M + 1) * self.ws2_per_row, device=dev, dtype=c.workspace2.dtype),
                         None, c.apply_router_weight_on_input)


class LayerWarmup:
    """Shapes seen, shapes warmed, and the warm-up itself, for one plugin. warm_variants is the
    function that warms our kernels for one shape (warm_moe_variants)."""

    def __init__(self, plugin: PluginHost) -> None:
        self.plugin = plugin
        self.pending: dict[LayerShape, LayerPlan] = {}
        self.warmed: set[LayerShape] = set()
        self.failed: set[LayerShape] = set()  # warm-up raised: not retried, serving may compile
        self.vllm_calls: dict[LayerShape, VllmCallTemplate] = {}
        self.vllm_warmed: set[LayerShape] = set()
        self.seconds = 0.0
        self.warm_variants: Callable[..., int] = warm_moe_variants

    def see(self, shape: LayerShape, plan: LayerPlan,
            template: Callable[[], VllmCallTemplate] | None = None) -> None:
        """A MoE call of this shape, whose layer has this plan, happened; queue it (and keep
        template() for vLLM warm-up calls, made once per shape). A shape first seen while serving (not under CUDA-graph
        capture) is warmed at once: its compiles then count as serving's."""
        if template is not None and shape not in self.vllm_calls:
            self.vllm_calls[shape] = template()
        if shape in self.warmed or shape in self.pending or shape in self.failed:
            return
        self.pending[shape] = plan
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self.plugin.phase == "serving" and not capturing:
            self.plugin.logger.warning("moe-serve: MoE shape first seen while serving, warming it up now: %s",
                                       shape)
            self.warm_pending()

    def warm_pending(self) -> None:
        """Warm every pending shape (ours and vLLM's kernel) and report its routing. A shape
        whose warm-up raises is counted as a warm-up failure and not retried; the others go on."""
        if not self.pending:
            return
        t0 = time.perf_counter()
        for shape, plan in list(self.pending.items()):
            del self.pending[shape]
            try:
                self._warm(shape, plan)
                self.warmed.add(shape)
            except Exception as exc:  # noqa: BLE001 - serve anyway; the failure is counted
                self.failed.add(shape)
                self.plugin.warmup_failed(f"layer warm-up of {shape}", exc)
        self.seconds += time.perf_counter() - t0
        self.plugin.report_warmup(self.seconds, len(self.warmed))

    def _warm(self, shape: LayerShape, layer: LayerPlan) -> None:
        p, s = self.plugin, time.perf_counter()
        max_tokens = (p.facts and p.facts.max_num_batched_tokens) or DEFAULT_MAX_TOKENS
        max_seqs = (p.facts and p.facts.max_num_seqs) or DEFAULT_MAX_SEQS
        E, N, K, wname = shape.E, shape.N, shape.K, shape.route_dtype
        rngs = [{"m_min": lo, "m_max": hi, "backend": b} for lo, hi, b in layer.ranges]
        plan = warmup_plan(rngs, max_seqs, max_tokens, shape.topk,
                           policy=routing.VLLM if layer.reason else layer.context.config.moe_routing,
                           cfg_key=_chooser(self.vllm_calls.get(shape), shape))
        desc = layer.describe()
        n = 0
        if plan["ours"]:
            n = self.warm_variants(E, N, K, shape.topk, shape.dtype, max_tokens, fp8=shape.fp8,
                                   device=shape.device, static_act=shape.static_act,
                                   router_weight_on_input=shape.router_on_input, ids_dtypes=(shape.ids_dtype,),
                                   per_token_act=shape.per_token_act, block_shape=shape.block_shape)
            swaps = {bool(c.config.get("SWAP_AB")) for c in layer.choices}
            p.set_swap_ab("mixed" if len(swaps) > 1 else str(swaps.pop()).lower())
        nv = self.warm_vllm(shape, plan["vllm"]) if plan["vllm"] else 0
        p.report_routing(routing.shape_key(E, N, K, wname), desc)
        print(f"[moe-serve layer warm-up] rank {p.rank}: E={E} N={N} K={K} topk={shape.topk} {shape.dtype} "
              f"fp8={shape.fp8}: ours {n} variants up to M={max_tokens}; vLLM kernel {nv} calls "
              f"({len(plan['vllm'])} planned M) in {time.perf_counter() - s:.1f}s; routing {desc}", flush=True)

    def warm_vllm(self, shape: LayerShape, ms: list[int]) -> int:
        """vLLM's original apply at each M in ms, once per shape; the number of calls made."""
        tmpl = self.vllm_calls.get(shape)
        if tmpl is None or shape in self.vllm_warmed:
            return 0
        self.vllm_warmed.add(shape)
        n = 0
        for M in ms:
            try:
                call_apply(tmpl.orig, tmpl.experts, tmpl.call_at(M))
                n += 1
            except Exception as exc:  # noqa: BLE001 - one failing M must not stop the others
                self.plugin.warmup_failed(f"vLLM kernel at M={M}", exc, once=type(exc).__name__)
        if tmpl.call.w1.device.type == "cuda":
            torch.cuda.synchronize()
        return n


def _chooser(tmpl: VllmCallTemplate | None, shape: LayerShape) -> Callable[[int], Any] | None:
    """vLLM's config choice per M for this layer, or None (then _vllm_group approximates)."""
    if tmpl is None:
        return None
    try:
        return vllm_config_chooser(tuple(tmpl.call.w1.shape), tuple(tmpl.call.w2.shape), shape.topk,
                                   shape.route_dtype)
    except Exception:  # noqa: BLE001
        return None


def _vllm_group(M: int, topk: int, cfg_key: Callable[[int], Any] | None) -> tuple:
    """Specialization class of vLLM's fused_moe_kernel for M tokens: its config bucket
    (vLLM's own choice when given, else ~ its key grid: powers of two and 1.5x), M == 1,
    and (M * topk) mod 16 (num_valid_tokens and EM = M*topk + const divisibility)."""
    if cfg_key is not None:
        ck = cfg_key(M)
    else:
        b = M.bit_length()
        ck = (b, M >= 3 << max(0, b - 2))
    return (ck, M == 1, (M * topk) % 16)


def warmup_plan(rngs: list[dict], max_seqs: int, max_tokens: int, topk: int,
                policy: str = "table", cfg_key: Callable[[int], Any] | None = None,
                max_calls: int | None = None) -> dict[str, Any]:
    """Which backend serves which M, and the M values to run vLLM's kernel at in warm-up.

    {"ours": bool (any M routed to ours -> compile our variants), "vllm": sorted M list,
    "dropped": M values cut by max_calls}. vLLM M list: every M in 1..min(max_seqs, max_tokens)
    routed to vLLM (decode batch sizes), plus for the prefill range (max_seqs, max_tokens] one M
    per specialization class of vLLM's kernel (_vllm_group), i.e. at most 16 per vLLM config
    bucket; capped at max_calls (default: the vllm_warmup_max_calls setting, 4096) keeping
    the decode M first."""
    def backend(M: int) -> str:
        return policy if policy in (routing.OURS, routing.VLLM) else routing.route_in(rngs, M)

    if max_calls is None:
        max_calls = current().vllm_warmup_max_calls
    top = max(1, max_tokens)
    dec = min(max_seqs, top)
    probe = sorted({1, top} | {r["m_min"] for r in rngs if r["m_min"] <= top})
    ours = any(backend(m) == routing.OURS for m in probe)
    ms = [m for m in range(1, dec + 1) if backend(m) == routing.VLLM]
    seen: set[tuple] = set()
    for m in range(dec + 1, top + 1):
        if backend(m) != routing.VLLM:
            continue
        g = _vllm_group(m, topk, cfg_key)
        if g not in seen:
            seen.add(g)
            ms.append(m)
    return {"ours": ours, "vllm": ms[:max_calls], "dropped": max(0, len(ms) - max_calls)}
