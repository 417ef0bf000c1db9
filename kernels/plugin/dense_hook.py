"""The plugin's dense hook: vLLM's unquantized linear layers (attention projections, dense MLPs,
a MoE gate the model computes itself, as Mixtral's) run on kernels.dense.decode_linear for calls
of M <= decode_linear.MAX_M tokens, and on vLLM's GEMM (F.linear) otherwise.

vLLM's UnquantizedLinearMethod.apply(layer, x, bias) is wrapped: for a bias-free 16-bit CUDA
weight and an input of the same dtype it calls the custom op ``moe_serve::dense_linear(x, w)``,
which picks ours or F.linear by the call's token count when it runs (the op is opaque to
torch.compile, so vLLM's compiled graphs and the CUDA graphs captured from them hold whichever
the captured size picked). Everything else (bias, quantized or fp32 weights, CPU, vLLM's
batch-invariant mode) calls vLLM's apply unchanged. The op records every weight shape it sees;
the plugin's warm-up compiles M = 1..MAX_M for each before vLLM captures its graphs, so serving
never compiles. Off unless MOE_SERVE_DENSE_DECODE=1 (`moe-serve --dense-decode`).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kernels.dense.decode_linear import MAX_M, decode_linear, eligible
from kernels.plugin.plugin_host import PluginHost

ENV = "MOE_SERVE_DENSE_DECODE"
DTYPES = (torch.bfloat16, torch.float16)


class DenseHook:
    """The apply wrapper, the shapes seen (for warm-up) and the plugin to count calls on.
    require_cuda: our kernel runs on CUDA weights only."""

    require_cuda = True

    def __init__(self, plugin: PluginHost) -> None:
        self.plugin = plugin
        self._weights: dict[tuple, torch.Tensor] = {}    # (N, K, dtype, device) -> a weight of it
        self._warmed: set[tuple] = set()

    def apply(self, orig: Callable) -> Callable:
        """make() for UnquantizedLinearMethod.apply."""
        def apply(method: Any, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            w = getattr(layer, "weight", None)
            if (bias is None and isinstance(w, torch.Tensor) and (w.is_cuda or not self.require_cuda)
                    and w.dtype in DTYPES and eligible(x, w)):
                return torch.ops.moe_serve.dense_linear(x, w)
            return orig(method, layer, x, bias)
        return apply

    def run(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The op's body: ours for 1..MAX_M tokens, else F.linear."""
        key = (w.shape[0], w.shape[1], w.dtype, str(w.device))
        if key not in self._weights:
            self._weights[key] = w
        if 1 <= x.shape[0] <= MAX_M:
            self.plugin.count_dense()
            return decode_linear(x, w)
        return F.linear(x, w)

    def warm_pending(self) -> int:
        """Run M = 1..MAX_M once on every weight shape seen and not yet warmed (compiles the
        kernels, allocates the split workspace before any graph capture); returns how many."""
        done = 0
        for key, w in list(self._weights.items()):
            if key in self._warmed:
                continue
            for M in range(1, MAX_M + 1):
                decode_linear(torch.zeros((M, w.shape[1]), dtype=w.dtype, device=w.device), w)
            self._warmed.add(key)
            done += 1
        return done


HOOK: DenseHook | None = None


def install(plugin: PluginHost) -> DenseHook:
    """This process's DenseHook, bound to the custom op (defined once per process)."""
    global HOOK
    HOOK = DenseHook(plugin)
    return HOOK


def enabled() -> bool:
    """MOE_SERVE_DENSE_DECODE: '1' on, '0' or unset off; anything else is a ValueError naming it."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
    return value == "1"


@torch.library.custom_op("moe_serve::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]: ours at 1..MAX_M tokens (kernels.dense.decode_linear)
    once the plugin installed the hook, else F.linear."""
    if HOOK is None:
        return F.linear(x, weight)
    return HOOK.run(x, weight)


@dense_linear.register_fake
def _dense_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
