"""One plan per MoE layer: for each M, which kernel serves the layer's experts (ours decode /
ours aligned, or vLLM's) with which table row, which pieces ours fuses, whether our router serves
its gate GEMM + top-k, and the reason for each; built once per layer, looked up by the hooks.

Built (`build`) from the layer's facts (LayerFacts: its shape and format, what the experts
support, its router's eligibility), read once, from vLLM's layer at its first forward in a worker
(kernels/plugin/moe_hook.py, kernels/plugin/router_hook.py) or from a model's config.json
(`moe-serve explain`), and the process's PlanContext: the PluginConfig (kernels/config.py), the
GPU's tables (device name, Triton version), the vLLM version and VLLM_BATCH_INVARIANT. The
decision itself is kernels/moe/selection.py's; the plan holds its result per bucket so the hot
path is a look-up (`route`, `config`, `router_serves`), and `lines` prints the same object for
explain, /version and the metrics.

Fail closed: what the layer needs and our kernels do not implement puts it on vLLM's path with the
reason: batch invariance (our kernels reduce in fp32 atomics whose order follows the batch), an
experts feature the MoE hook does not take (kernels/plugin/moe_hook.py's unsupported_reason), a
router that is not a plain softmax / sigmoid top-k (+ correction bias) or has a routing term
ours ignores (vLLM 0.32's image-token bias ``bias_vl``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.moe import configs, quant_format, routing, selection
from moe_serve.kernels.moe.config_schema import Config, down_config, label
from moe_serve.kernels.moe.router_topk import max_tokens

BATCH_INVARIANT = ("VLLM_BATCH_INVARIANT is set: our kernels sum in fp32 atomics and split-K, whose order "
                   "follows the batch")


@dataclass(frozen=True)
class RouterSpec:
    """What router_topk needs of one layer's router, read from vLLM's router object."""

    topk: int
    scoring: str                # 'softmax' | 'sigmoid'
    renormalize: bool
    scaling: float              # routed_scaling_factor (bias routers), else 1
    bias: Any                   # e_score_correction_bias [E] torch.Tensor (choice only), or None
    max_m: int                  # the largest call (tokens) ours serves: router_topk.max_tokens(E, K)


@dataclass(frozen=True)
class PlanContext:
    """What every layer's plan of one process shares."""

    config: PluginConfig
    device: str                 # the tables' GPU name (configs.device_name), 'cpu' without one
    triton_version: str | None  # the Triton the kernels run under (None: this one)
    vllm_version: str
    batch_invariant: bool = False


@dataclass(frozen=True)
class LayerFacts:
    """A MoE layer as the plan needs it (per TP rank)."""

    E: int
    N: int                      # intermediate size per rank (w1 is [E, 2N, K])
    K: int                      # hidden size
    topk: int
    fmt: str                    # moe_serve.kernels.moe.quant_format key ('bf16', 'fp8', 'fp8_w8a8,per_token', ...)
    act_bytes: int = 2          # itemsize of the hidden states the experts get (fp8: 1)
    experts_unsupported: str | None = None   # why ours cannot run these experts at all, else None
    router: RouterSpec | str | None = None   # its router's spec, why ours cannot run it, or None: not seen
    name: str = ""
    layers: int = 1

    @property
    def shape_key(self) -> str:
        return routing.shape_key(self.E, self.N, self.K, self.fmt)


@dataclass(frozen=True)
class RouterPlan:
    """Our one-launch router for calls of M <= spec.max_m tokens, or vLLM's router (spec None)."""

    spec: RouterSpec | None
    reason: str

    def serves(self, M: int) -> bool:
        return self.spec is not None and M <= self.spec.max_m


@dataclass(frozen=True)
class LayerPlan:
    """One layer's kernels per M (see the module doc)."""

    facts: LayerFacts
    context: PlanContext
    ranges: tuple[tuple[int, int | None, str], ...]   # (m_min, m_max or None, 'ours' | 'vllm'), by M
    rule: str                                          # what set the ranges: moe_routing, a table, the default rule
    buckets: tuple[int, ...]                           # the M buckets that pick configs
    choices: tuple[selection.ConfigChoice, ...]        # the config ours runs per bucket, after the smem fit
    reason: str | None                                 # why vLLM serves every M (fail closed), else None
    reason_key: str | None                             # the same for the fallback metric's label
    router: RouterPlan
    block_pdl: bool                                    # our router and decode up kernel chained by PDL too
    _index: dict[int, int] = field(init=False, compare=False, repr=False)   # bucket -> its position

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {b: i for i, b in enumerate(self.buckets)})

    # -- the hot path -------------------------------------------------------------------------
    def route(self, M: int) -> str:
        """'ours' or 'vllm' for a call of M tokens."""
        if self.reason is None:
            for lo, hi, backend in self.ranges:
                if lo <= M and (hi is None or M <= hi):
                    return backend
        return routing.VLLM

    def config(self, M: int) -> Config:
        """The table row (or default) ours runs for M tokens."""
        return self.choices[self._index[configs.bucket_of(M, self.buckets)]].config

    def router_serves(self, M: int) -> bool:
        return self.router.serves(M)

    # -- reports ------------------------------------------------------------------------------
    def select(self, M: int) -> selection.Selection:
        """The whole decision for M tokens, with the evidence behind the route."""
        f, ctx = self.facts, self.context
        choice = self.choices[self._index[configs.bucket_of(M, self.buckets)]]
        rc = selection.route_choice(f.E, f.N, f.K, f.fmt, M, ctx.device, f.topk, ctx.triton_version,
                                    policy=ctx.config.moe_routing)
        if self.reason is not None:
            return selection.Selection(M, selection.VLLM, choice, rc, self.reason)
        backend = self.route(M)
        if backend != routing.OURS:
            at = "" if rc.measured_m is None else f" (measured at M={rc.measured_m})"
            return selection.Selection(M, selection.VLLM, choice, rc, f"routed to vLLM: {rc.why}{at}")
        path = selection.OURS_DECODE if choice.config.get("DECODE") else selection.OURS_ALIGNED
        return selection.Selection(M, path, choice, rc, None)

    def fused(self, M: int) -> tuple[str, ...]:
        """What ours fuses for M tokens (empty where vLLM serves)."""
        if self.route(M) != routing.OURS:
            return ()
        cfg, out = self.config(M), []
        if self.router_serves(M):
            out.append("gate GEMM + top-k")
        if cfg.get("DECODE"):
            out += ["SiLU-and-mul in up", "routed weight + top-k sum in down"]
            if cfg.get("PDL"):
                out.append("block PDL" if self.block_pdl else "down PDL")
        else:
            gu = cfg.get("FUSE_GU", True) and int(cfg.get("SPLIT_K", 1)) == 1
            out += ["SiLU-and-mul in GEMM1" if gu else "SiLU-and-mul on GEMM2's load",
                    "routed weight in GEMM2" + (" + top-k sum (atomics)" if down_config(cfg).get("SPLIT_K", 1) > 1
                                                else "")]
        return tuple(out)

    def describe(self) -> str:
        """The ranges in short: '1-16:ours,17+:vllm' (the routing info metric's label)."""
        if self.reason is not None:
            return "all:vllm(fail closed)"
        if self.rule.startswith("moe_routing="):
            return f"all:{self.ranges[0][2]}"
        text = routing.format_ranges([{"m_min": lo, "m_max": hi, "backend": b} for lo, hi, b in self.ranges])
        return text or "all:vllm(unmeasured)"

    def summary(self) -> str:
        """One line: the experts' ranges, the router, what fails closed (the plan info metric)."""
        router = (f"ours M<={self.router.spec.max_m}" if self.router.spec is not None
                  else f"vllm ({self.router.reason})")
        tail = f"; vLLM: {self.reason}" if self.reason else ""
        return f"experts {self.describe()}; router {router}{tail}"

    def lines(self, ms: list[int]) -> list[str]:
        """The plan as `moe-serve explain` prints it, for the M values ms."""
        f = self.facts
        first = self.choices[0]
        table = first.detail if first.source != selection.DEFAULT_RULE else "none (default rule)"
        out = [f"{f.name}: E={f.E} N={f.N} K={f.K} topk={f.topk} {f.fmt}, {f.layers} layers",
               f"  config table: {table}", f"  routing: {self.describe()} ({self.rule})"]
        out += [f"  refused: {why}" for why in first.refused]
        if self.reason:
            out.append(f"  fail closed: {self.reason}")
        out.append(f"  {'M':>6}  {'path':12}  {'config':36}  {'source':38}  {'ratio':>13}  why")
        for M in ms:
            s = self.select(M)
            source = (s.config.source if s.config.source != selection.DEFAULT_RULE
                      else f"default: {s.config.detail}")
            ratio = "-" if s.route.ratio is None else f"{s.route.ratio:.3f}x@M={s.route.measured_m}"
            why = (s.fallback or s.route.why) + (f"; smem fit: {', '.join(s.config.shrunk)}"
                                                if s.config.shrunk else "")
            fused = self.fused(M)
            out.append(f"  {M:>6}  {s.path:12}  {s.config.label:36}  {source:38}  {ratio:>13}  {why}"
                       + (f"; fused: {', '.join(fused)}" if fused else ""))
        return out + ["  " + self.router_line()]

    def router_line(self) -> str:
        f, spec = self.facts, self.router.spec
        if spec is None:
            return f"router: vLLM's gate GEMM + top-k at every M ({self.router.reason})"
        return (f"router: ours (gate GEMM + top-k in one launch) at M <= {spec.max_m}, vLLM's above "
                f"({spec.scoring} top-{spec.topk}{' + correction bias' if spec.bias is not None else ''}"
                f", [{f.E}, {f.K}] gate)")


@dataclass(frozen=True)
class HookPlan:
    """Which kernel hooks a worker installs (None) or not (the reason), from its context: made once
    at worker init, before the model is built."""

    moe: str | None
    router: str | None          # with it, runner_gate (the gate moved into the runner)
    dense: str | None
    fused_model: str | None     # our model classes (kernels/models): the fused decode-step pieces
    fp8_dense: str | None       # the FP8 linear methods at decode on our FP8 GEMV
    attention: str | None       # decode batches' attention on our decode kernel

    @classmethod
    def of(cls, ctx: PlanContext) -> "HookPlan":
        cfg = ctx.config
        if cfg.mode != "optimized":
            return cls(*(["mode vllm"] * 6))

        def setting(on: bool, name: str) -> str | None:
            return BATCH_INVARIANT if ctx.batch_invariant else None if on else f"the {name} setting is off"
        return cls(None, None if cfg.fused_router else "the fused_router setting is off",
                   setting(cfg.dense_gemv, "dense_gemv"),
                   setting(cfg.fuse_norm_gemv or cfg.fuse_qk_norm_rope, "fuse_norm_gemv / fuse_qk_norm_rope"),
                   setting(cfg.fp8_dense_gemv, "fp8_dense_gemv"), setting(cfg.decode_attention, "decode_attention"))


def attention_plan(impl: Any) -> str | None:
    """An attention layer's plan under the decode_attention setting (kernels/plugin/attention_hook.py
    looks it up once per layer): None, our decode kernel serves its decode batches; else why
    vLLM's FlashAttention keeps them (a feature our kernel does not implement: fail closed)."""
    if str(getattr(impl, "attn_type", "decoder")) not in ("decoder", "AttentionType.DECODER"):
        return f"attention type {impl.attn_type}"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.logits_soft_cap:
        return "logit soft-capping"
    if impl.sliding_window is not None and tuple(impl.sliding_window) != (-1, -1):
        return "a sliding window"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if impl.kv_cache_dtype != "auto":
        return f"KV cache dtype {impl.kv_cache_dtype}"
    if getattr(impl, "dcp_world_size", 1) != 1:
        return "decode context parallelism"
    return None


def router_plan(router: RouterSpec | str | None, ctx: PlanContext) -> RouterPlan:
    """For a router's spec (or why ours cannot run it; None: not seen): ours where the settings
    ask for it, the router is eligible and the batch need not be invariant; else vLLM's, with why."""
    cfg = ctx.config
    if cfg.mode != "optimized" or not cfg.fused_router:
        return RouterPlan(None, "the fused_router setting is off" if cfg.mode == "optimized"
                          else "mode vllm")
    if ctx.batch_invariant:
        return RouterPlan(None, BATCH_INVARIANT)
    if router is None:
        return RouterPlan(None, "its router was not seen (no runner holding the gate ran before it)")
    if isinstance(router, str):
        return RouterPlan(None, router)
    return RouterPlan(router, f"eligible, M <= {router.max_m}")


def _ranges(f: LayerFacts, ctx: PlanContext) -> tuple[tuple[tuple[int, int | None, str], ...], str]:
    policy = ctx.config.moe_routing
    if policy != "table":
        return ((1, None, policy),), f"moe_routing={policy}"
    rngs = selection.ranges(f.E, f.N, f.K, f.fmt, ctx.device, f.topk, ctx.triton_version)
    rule = selection.route_choice(f.E, f.N, f.K, f.fmt, 1, ctx.device, f.topk, ctx.triton_version,
                                  policy=policy).rule
    return tuple((r["m_min"], r["m_max"], r["backend"]) for r in rngs), rule


def fp8_gemv(f: LayerFacts, ctx: PlanContext) -> bool:
    """Whether the fp8_moe_gemv setting puts this layer's decode batches on our FP8 GEMV path: an
    FP8 layer our kernels take, in optimized mode with the table's routing, no batch invariance."""
    cfg = ctx.config
    return (cfg.fp8_moe_gemv and cfg.mode == "optimized" and cfg.moe_routing == "table"
            and quant_format.is_fp8(f.fmt) and not ctx.batch_invariant and not f.experts_unsupported)


def build(facts: LayerFacts, ctx: PlanContext) -> LayerPlan:
    """The layer's plan (see the module doc)."""
    f = facts
    buckets = selection.buckets_for(f.E, f.N, f.K, f.fmt, ctx.device, ctx.triton_version)
    choices = tuple(selection.config_choice(b, f.E, f.N, f.K, f.topk, f.fmt, ctx.device, f.act_bytes,
                                            ctx.triton_version) for b in buckets)
    ranges, rule = _ranges(f, ctx)
    if fp8_gemv(f, ctx):    # FP8 at decode on the weight-streaming GEMV path, the rest as routed
        buckets = tuple(sorted(set(buckets) | set(selection.FP8_GEMV_BUCKETS)))
        small = selection.FP8_GEMV_BUCKETS[-1]
        choices = tuple(selection.fp8_gemv_choice(b, f.E, f.N, f.K, f.topk, f.fmt, ctx.device, f.act_bytes,
                                                  ctx.triton_version) if b <= small else
                        selection.config_choice(b, f.E, f.N, f.K, f.topk, f.fmt, ctx.device, f.act_bytes,
                                                ctx.triton_version) for b in buckets)
        ranges = ((1, small, routing.OURS), *((max(lo, small + 1), hi, backend) for lo, hi, backend in ranges
                                              if hi is None or hi > small))
        rule = f"{selection.FP8_GEMV} at M <= {small}; {rule} above"
    reason = key = None
    if ctx.config.mode != "optimized":
        reason, key = "mode vllm", "mode_vllm"
    elif ctx.batch_invariant:
        reason, key = BATCH_INVARIANT, "batch_invariant"
    elif f.experts_unsupported:
        reason, key = f"unsupported by ours: {f.experts_unsupported}", f.experts_unsupported
    return LayerPlan(f, ctx, ranges, rule, buckets, choices, reason, key, router_plan(f.router, ctx),
                     ctx.config.block_pdl)


def config_router(cfg: dict[str, Any], E: int, K: int, topk: int) -> RouterSpec | str:
    """A router's spec, or why ours cannot run it, from a model's config.json (explain): plain
    softmax / sigmoid top-k (+ noaux_tc's correction bias) is ours; grouped top-k, other scoring
    functions and gates too large for one launch are vLLM's."""
    scoring = cfg.get("scoring_func") or "softmax"
    if int(cfg.get("n_group") or 1) > 1:
        return f"grouped top-k ({cfg.get('topk_method') or 'n_group'} over {cfg['n_group']} groups)"
    if scoring not in ("softmax", "sigmoid"):
        return f"scoring:{scoring}"
    limit = max_tokens(E, K)
    if limit < 1:
        return f"gate [{E}, {K}] too large for one launch"
    bias = "correction bias" if cfg.get("topk_method") == "noaux_tc" else None
    return RouterSpec(topk, scoring, bool(cfg.get("norm_topk_prob", True)),
                      float(cfg.get("routed_scaling_factor") or 1.0), bias, limit)
