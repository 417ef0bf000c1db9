"""kernels/models/runner_gate.py: a block that computes its gate in the model hands it to its MoE
runner, and then passes its hidden states for the logits, with the same output as before (a
stand-in block and vLLM's own Mixtral classes here; the real Mixtral served on the CPU engine in
tests/test_router_hook.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.kernels.models import runner_gate

E, K = 4, 8


class _Gate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, K))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class _Runner(torch.nn.Module):
    """vLLM's MoERunner contract: with a gate of its own it computes the logits from what it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: torch.nn.Module | None = None
        self.got: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        self.got.append(router_logits)
        if self.gate is not None:
            router_logits, _ = self.gate(hidden)
        return hidden * router_logits.softmax(-1).max(-1, keepdim=True).values


class _Block(torch.nn.Module):
    """Mixtral's MoE block: the gate in the model, the logits handed to the runner."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden_size = K
        self.gate = _Gate()
        self.experts = _Runner()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_size)
        router_logits, _ = self.gate(hidden_states)
        return self.experts(hidden_states, router_logits).view(orig_shape)


def test_the_gate_moves_into_the_runner_and_the_output_is_unchanged() -> None:
    torch.manual_seed(0)
    block, plain = _Block(), _Block()
    with torch.no_grad():
        plain.gate.weight.copy_(block.gate.weight)
    assert runner_gate.move_gate(block)
    assert block.experts.gate is block.gate and isinstance(block, _Block) and type(block) is not _Block
    assert type(block) is runner_gate.gated_class(_Block)                 # one subclass per block class
    assert [n for n, _ in block.named_parameters()] == ["gate.weight"]     # checkpoint name, once
    x = torch.randn(2, 3, K)                                               # 2-D and 3-D inputs alike
    torch.testing.assert_close(block(x), plain(x))
    assert block.experts.got[-1].shape == (6, K) and plain.experts.got[-1].shape == (6, E)
    torch.testing.assert_close(block.experts.got[-1], x.view(-1, K))      # hidden states for logits


def test_a_block_that_does_not_fit_is_left_as_built() -> None:
    moved = _Block()
    assert runner_gate.move_gate(moved)
    assert not runner_gate.move_gate(moved)                # its runner holds a gate now
    owned = _Block()
    owned.experts.gate = _Gate()                           # a runner with a gate of its own
    no_weight = _Block()
    no_weight.gate = torch.nn.Identity()
    for block in (owned, no_weight):
        assert not runner_gate.move_gate(block) and type(block) is _Block
    x = torch.randn(3, K)
    torch.testing.assert_close(owned(x), _Block.forward(owned, x))
    assert owned.experts.got[-1].shape == (3, E)


def test_vllms_mixtral_block_is_what_gated_forward_stands_in_for() -> None:
    """The pin on vLLM's MixtralMoE: its forward computes the gate and hands the logits to its
    runner, its __init__ registers the gate first (the real model's move: tests/kernels/test_fused_model.py)."""
    from moe_serve.kernels.plugin import vllm_pins

    assert vllm_pins.pin_runner_gate() == "MixtralMoE.forward / __init__"
