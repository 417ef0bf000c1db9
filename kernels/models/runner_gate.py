"""Move a MoE block's gate into vLLM's MoE runner where the model computes it outside, so the
router hook (kernels/plugin/router_hook.py) can serve the gate GEMM and top-k at decode in one
launch, as it does for models that hand their gate to the runner (Qwen3-MoE).

Mixtral's block computes ``router_logits, _ = self.gate(h)`` in the model and passes the logits
to its runner (``self.experts``, vLLM's MoERunner). `move_gate(block)`, called by our model class
once vLLM has built the model (kernels/models/mixtral.py, before the weights load), gives the
runner the block's gate (``runner.gate``, which the runner's forward computes the logits with
when set, in vLLM 0.26 and 0.32 alike; the gate's parameters keep their checkpoint names, the
block having registered them first) and makes the block a subclass whose forward passes the
hidden states in place of the logits, as vLLM's own Qwen3-MoE block does: the runner computes
the gate itself, inside vLLM's opaque MoE op, where the router hook can replace it. A block
whose runner already holds a gate, or whose parts are not a gate module and a runner, is left
as vLLM built it. moe_serve.service.engine keys vLLM's compile cache on it, since the traced graph changes.
"""
from __future__ import annotations

import functools
from typing import Any

import torch


def movable(block: Any) -> bool:
    """Whether the block's gate can go into its runner: a gate with a 2-D weight, a runner with
    an empty gate slot (vLLM's MoERunner.gate)."""
    gate, runner = getattr(block, "gate", None), getattr(block, "experts", None)
    w = getattr(gate, "weight", None)
    return (isinstance(gate, torch.nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2
            and isinstance(runner, torch.nn.Module) and hasattr(runner, "gate") and runner.gate is None)


def gated_forward(block: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The moved block's forward: its runner computes the logits from the hidden states [..., hidden]."""
    orig_shape = hidden_states.shape
    h = hidden_states.view(-1, block.hidden_size)                       # [T, hidden]
    return block.experts(h, h).view(orig_shape)


@functools.cache
def gated_class(cls: type) -> type:
    """cls with gated_forward (one subclass per block class)."""
    return type(f"Gated{cls.__name__}", (cls,), {"forward": gated_forward, "__module__": __name__})


def move_gate(block: Any) -> bool:
    """Hand the block's gate to its runner and switch it to gated_forward where `movable`;
    whether it moved."""
    if not movable(block):
        return False
    block.experts.gate = block.gate
    block.__class__ = gated_class(type(block))
    return True
