"""The plugin's dense-GEMV hook: vLLM's unquantized linear layers (QKV, O and MLP projections,
routers' gates) and the unquantized lm_head go through torch.ops.moe_serve.dense_linear
(kernels/dense/op.py), which runs our decode GEMV (kernels/dense/gemv.py) for 1..8 tokens on
CUDA where a tuned table (kernels/dense/configs/) lists the weight's shape and the token count's
bucket for this GPU, and F.linear otherwise.

Where: ``UnquantizedLinearMethod.apply`` and ``UnquantizedEmbeddingMethod.apply`` (the lm_head's,
called by vLLM's logits processor), wrapped on the classes (points pinned in
kernels/plugin/vllm_compat.py). vLLM has no extension point for unquantized GEMMs that a plugin
can add a backend to: kernel_config.linear_backend names a closed set (in 0.26 it picks kernels
of quantized layers only; in 0.32 also FlashInfer's bf16 GEMM), and replacing the layer classes
(PluggableLayer.register_oot, keyed by class name) would mean one subclass per linear layer
type. The wrapper is traced by torch.compile like the code it wraps, so the op is one opaque
node of the compiled graph and CUDA-graph capture records its launch; its checks read only what
tracing knows (dtypes, device, shapes, strides).

Taken: a layer whose vLLM apply is F.linear on CUDA (vllm_compat.default_dense_gemm), a 2-D
weight in bf16, fp16 or fp32 with unit stride along K and K a multiple of 16 bytes, x of the same
dtype on the same CUDA device; a bias [N] or none (added in fp32 by the kernel). Everything else
runs vLLM's apply unchanged, and the op itself falls back to F.linear for M > 8 and for layouts
only the data can rule out (16-byte alignment). Not installed with VLLM_BATCH_INVARIANT (vLLM's
batch-invariant GEMM) set (the worker's HookPlan, kernels/plugin/layer_plan.py). Installed in
optimized mode with the dense_gemv setting (on by default, under moe-serve and `vllm serve` alike;
kernels/config.py, `moe-serve --no-dense-gemv`).

Warm-up: every weight the op has seen (vLLM's profile run passes each layer once) gets the
variants it serves at M = 1..8 compiled before vLLM captures its CUDA graphs (warm_pending), so serving
compiles nothing.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from moe_serve.kernels.dense import op
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin.plugin_host import PluginHost

class DenseHook:
    """The apply wrappers, and the weights warmed so far, for one plugin."""

    def __init__(self, plugin: PluginHost) -> None:
        self.plugin = plugin
        self._warmed: set[op.ShapeKey] = set()
        self._reported: set[op.ShapeKey] = set()
        self._is_default = vc.default_dense_gemm()

    def install(self) -> list[str]:
        """Wrap both methods' apply (once); the names of what was wrapped. (The worker's HookPlan,
        kernels/plugin/layer_plan.py, installs it only without VLLM_BATCH_INVARIANT.)"""
        done = []
        for where in vc.DENSE_METHODS:
            if vc.wrap_method(vc.load(where), "apply", self.apply):
                done.append(f"{where[1]}.apply")
        return done

    def apply(self, orig: Callable) -> Callable:
        """make() for the methods' apply(self, layer, x, bias=None)."""
        is_default = self._is_default

        def apply(method: Any, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            weight = getattr(layer, "weight", None)
            if is_default(method) and op.static_support(x, weight, bias):
                return op.dense_linear(x, weight, bias)
            return orig(method, layer, x, bias)
        return apply

    def warm_pending(self) -> int:
        """Compile the kernel variants (M = 1..8) of every weight the op has seen and not yet
        warmed, and log (once each) the weights whose small calls went to F.linear; returns how
        many weights were warmed."""
        for key, why in op.fallbacks().items():
            if key not in self._reported:
                self._reported.add(key)
                self.plugin.logger.warning("moe-serve dense GEMV: weight [%d, %d] %s ran F.linear at <= %d tokens: %s",
                                           key[0], key[1], key[2], op.MAX_M, why)
        done = 0
        for key, (weight, bias) in op.seen().items():
            if key in self._warmed:
                continue
            n = op.warm_variants(weight, bias)
            self._warmed.add(key)
            what = (f"{n} variants warmed for M = 1..{op.MAX_M}" if n else
                    "F.linear at every M: no tuned table lists it for this GPU (`moe-serve tune --model DIR`)")
            self.plugin.logger.info("moe-serve dense GEMV: weight %s %s%s: %s", list(weight.shape), weight.dtype,
                                    " + bias" if bias is not None else "", what)
            done += 1
        return done
