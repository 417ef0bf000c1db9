"""Move a MoE block's gate into vLLM's MoE runner where the model computes it outside, so the
router hook (kernels/plugin/router_hook.py) can serve the gate GEMM and top-k at decode in one
launch, as it does for models that hand their gate to the runner (Qwen3-MoE).

Mixtral's block computes ``router_logits, _ = self.gate(h)`` in the model and passes the logits
to its runner (``self.experts``, vLLM's MoERunner). Wrapped here, at construction the block
gives the runner its gate (``runner.gate``, which the runner's forward computes the logits with
when set, in vLLM 0.26 and 0.32 alike; the gate's parameters keep their checkpoint names, the
block registering them first), and its
forward then passes the hidden states in place of the logits, as vLLM's own Qwen3-MoE block does:
the runner computes the gate itself, inside vLLM's opaque MoE op, where the router hook can
replace it. A block whose runner already holds a gate, or whose parts are not a gate module and
a runner, is left as vLLM built it. Installed with the router hook (optimized mode, with
the fused_router setting); service.engine keys vLLM's compile cache on it, since the traced graph
changes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kernels.plugin import vllm_compat as vc


def movable(block: Any) -> bool:
    """Whether the block's gate can go into its runner: a gate with a 2-D weight, a runner with
    an empty gate slot (vLLM's MoERunner.gate)."""
    gate, runner = getattr(block, "gate", None), getattr(block, "experts", None)
    w = getattr(gate, "weight", None)
    return (isinstance(gate, torch.nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2
            and isinstance(runner, torch.nn.Module) and hasattr(runner, "gate") and runner.gate is None)


def wrap_init(orig: Callable) -> Callable:
    """make() for the block's __init__: hand the gate to the runner once built."""
    def __init__(block: Any, *args: Any, **kwargs: Any) -> None:
        orig(block, *args, **kwargs)
        if movable(block):
            block.experts.gate = block.gate
    return __init__


def wrap_forward(orig: Callable) -> Callable:
    """make() for the block's forward: with the gate in the runner, the hidden states stand for
    the logits (the runner computes them); else vLLM's forward."""
    def forward(block: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if getattr(block.experts, "gate", None) is not block.gate:
            return orig(block, hidden_states)
        orig_shape = hidden_states.shape
        h = hidden_states.view(-1, block.hidden_size)                   # [T, hidden]
        return block.experts(h, h).view(orig_shape)
    return forward


def install() -> list[str]:
    """Wrap every known block class that imports; the wrapped methods' names."""
    done = []
    for where in vc.GATED_BLOCKS:
        cls = vc.load(where)
        for name, make in (("__init__", wrap_init), ("forward", wrap_forward)):
            if vc.wrap_method(cls, name, make):
                done.append(f"{cls.__name__}.{name}")
    return done
