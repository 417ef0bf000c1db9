"""A worker's layer plans (kernels/plugin/layer_plan.py): the context they share, built once from
the worker's PluginConfig, GPU, Triton and vLLM, and one plan per distinct MoE layer, made when
the layer first runs (vLLM's profile run, before serving) and reported.

vLLM hands the two hooks of one layer different objects: the router hook its runner (which holds
the gate and router), the MoE hook its experts. The router part of a layer's plan is made from
the runner and kept under the runner's expert weight (runner.routed_experts.w13_weight), which the
experts' call then carries as w1: the layer's plan joins both (the runner runs first in a
forward). Where no router plan was made for the weight (router hook off, a runner without the
gate), the plan's router is vLLM's, "not seen".
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from moe_serve.kernels.moe import configs
from moe_serve.kernels.plugin import layer_plan
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin.layer_plan import LayerFacts, LayerPlan, PlanContext, RouterPlan, RouterSpec


class PlanBook:
    """The plans of one worker; report(plan) is called once per new layer plan."""

    def __init__(self, config: Callable[[], Any], report: Callable[[LayerPlan], None]) -> None:
        self._config = config                 # the plugin's PluginConfig (final once the worker started)
        self._report = report
        self._context: PlanContext | None = None
        self.layers: dict[LayerFacts, LayerPlan] = {}
        self._routers: dict[int, RouterSpec | str] = {}   # data_ptr of a runner's w13_weight -> its router

    @property
    def context(self) -> PlanContext:
        """Made at the first plan (after worker init: the worker's config, its GPU)."""
        if self._context is None:
            self._context = PlanContext(self._config(), configs.device_name(), None, vc.vllm.__version__,
                                        vc.batch_invariant())
        return self._context

    def layer(self, facts: LayerFacts, w1: Any) -> LayerPlan:
        """The plan of a layer with these facts and expert weight w1 (its runner's router joined)."""
        router = self._routers.get(_ptr(w1))
        if router is not None:
            facts = replace(facts, router=router)
        plan = self.layers.get(facts)
        if plan is None:
            plan = self.layers[facts] = layer_plan.build(facts, self.context)
            self._report(plan)
        return plan

    def router(self, runner: Any, spec: RouterSpec | str) -> RouterPlan:
        """The router part of a runner's layer plan; remembered for its experts' call."""
        weight = vc.experts_weight(runner)
        if weight is not None:
            self._routers[_ptr(weight)] = spec
        return layer_plan.router_plan(spec, self.context)


def _ptr(tensor: Any) -> int:
    return tensor.data_ptr() if hasattr(tensor, "data_ptr") else id(tensor)
