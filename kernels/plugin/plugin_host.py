"""What the plugin's parts (kernels/plugin/moe_hook.py, kernels/plugin/layer_warmup.py,
kernels/plugin/router_hook.py, kernels/plugin/expert_load.py) need from the plugin
object (moe_serve.kernels.plugin.vllm_plugin.MoePlugin), as a Protocol: the parts import nothing above them."""
from __future__ import annotations

import logging
from typing import Any, Protocol

from moe_serve.kernels.plugin.layer_plan import LayerFacts, LayerPlan, RouterPlan, RouterSpec
from moe_serve.kernels.plugin.vllm_compat import WorkerFacts


class PluginHost(Protocol):
    """The plugin seen from its parts: phase, worker facts, logging and reporting."""

    phase: str                  # 'warmup' until the plugin serves, then 'serving'
    logger: logging.Logger
    facts: WorkerFacts | None   # None outside a worker (API process, engine core)

    @property
    def rank(self) -> int | None: ...

    def count_launch(self, path: str) -> None: ...

    def count_fallback(self, reason: str) -> None: ...

    def count_router(self) -> None: ...

    @property
    def counts_experts(self) -> bool: ...

    def expert_counts(self, router: Any) -> tuple[Any, Any] | None:
        """(counts [E] int64, num_tokens [1] int32) for our router kernel to add this call's
        experts to (kernels/plugin/expert_load.py); None when the router's layer is not counted."""

    def plan_for(self, facts: LayerFacts, w1: Any) -> LayerPlan:
        """The plan of a MoE layer with these facts (w1: its experts' [E, 2N, K] weight, which
        joins it to the router its runner's plan saw); made once per distinct layer."""

    def router_plan(self, runner: Any, spec: RouterSpec | str) -> RouterPlan:
        """The router part of a runner's layer plan, for its eligibility (spec or why not)."""

    def log_once(self, kind: str, message: str, *args: Any) -> None: ...

    def warmup_failed(self, what: str, exc: BaseException, once: str | None = None) -> None: ...

    def set_swap_ab(self, value: str) -> None: ...

    def report_routing(self, shape: str, desc: str) -> None: ...

    def report_warmup(self, seconds: float, shapes: int) -> None: ...
