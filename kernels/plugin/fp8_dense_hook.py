"""The plugin's FP8 dense hook: vLLM's FP8 linear layers (QKV, O, dense MLPs of FP8 checkpoints)
go through torch.ops.moe_serve.fp8_dense_linear (kernels/dense/op_fp8.py), which runs our FP8
decode GEMV (kernels/dense/gemv_fp8.py) at 1..16 tokens on CUDA where a tuned table lists the
layer's shape, format and the token count's bucket for this GPU, and the layer's own vLLM apply
otherwise (called from inside the op).

Where: the two FP8 linear methods of vLLM 0.26 and 0.32 (kernels/plugin/fp8_dense_pins.py pins
them): ``Fp8LinearMethod`` (quant_method fp8: per-tensor weight scales ``weight_scale``, or
[128, 128] blocks ``weight_scale_inv``: Qwen3-*-FP8, DeepSeek-V3) and the compressed-tensors
scheme ``CompressedTensorsW8A8Fp8`` (per-channel ``weight_scale`` [N, 1] with per-token dynamic
activations: FP8-dynamic; per-tensor; block). Each has its ``process_weights_after_loading``
wrapped, which after vLLM's own reads the layer's final storage once (layout_of) and marks the
layer with its Fp8Layout, and its ``apply`` / ``apply_weights`` wrapped, which hands a marked
layer's float x to the op with the tensors as stored (no copy):

    per tensor / per channel   weight [K', N'] with unit stride along K (the transposed view
                               vLLM's CUTLASS kernel takes; N', K' padded to 16 where they were
                               not), scale one value or [N'(, 1)] (padded with 1.0);
    block                      weight [N, K] row-major, scale [cdiv(N, bn), cdiv(K, bk)] fp32,
                               row-major or DeepGEMM's MN-major copy; e8m0 scales stay vLLM's.

Layers left to vLLM entirely: another weight layout (Marlin's repack on GPUs without FP8, a
future change), K % 16 != 0, non-fp32 scales, an output dtype other than the activation's, a
layer whose shape and format no tuned table lists (the op would only add a call), and any x
that is not a plain tensor (0.26's pre-quantized QuantizedActivation). vLLM builds no FP8
lm_head through these methods (ParallelLMHead is not a LinearBase: the FP8 checkpoints' lm_head
is bf16, served by kernels/plugin/dense_hook.py). A static activation scale (activation_scheme
static) is not applied: x is never quantized (W8A16; vLLM's output differs by its activation
rounding). Not installed with VLLM_BATCH_INVARIANT set, in vllm mode, or with the fp8_dense_gemv
setting off (kernels/config.py; off by default).

Warm-up: warm_pending compiles the variants of every weight the op has seen (vLLM's profile run
passes each layer) before vLLM captures its CUDA graphs, so serving compiles nothing.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple

import torch

from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.dense import op_fp8
from moe_serve.kernels.dense.configs import fp8_key, load_table
from moe_serve.kernels.dense.gemv import DTYPES, device_facts
from moe_serve.kernels.dense.gemv_fp8 import FP8, SCALE_CHANNEL, VEC, scale_layout
from moe_serve.kernels.plugin import vllm_compat as vc

FP8_LINEAR = ("vllm.model_executor.layers.quantization.fp8", "Fp8LinearMethod")
CT_FP8 = ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8",
          "CompressedTensorsW8A8Fp8")
METHODS = ((FP8_LINEAR, "apply"), (CT_FP8, "apply_weights"))   # (class, its apply) wrapped with its load
LOAD = "process_weights_after_loading"
MARK = "_moe_serve_fp8_dense"                                   # the layer's Fp8Layout


class Fp8Layout(NamedTuple):
    """How a layer's FP8 weight is stored after vLLM's process_weights_after_loading (constants
    under torch.compile)."""

    n: int                       # output features
    k: int                       # input features
    weight_kn: bool              # stored [K', N'] with unit stride along K (else [N', K'] row-major)
    block_n: int                 # block scales' [block_n, block_k]; 0 for per tensor / channel
    block_k: int
    scale_attr: str              # weight_scale | weight_scale_inv
    fmt: str                     # moe_serve.kernels.dense.configs.fp8_key of the scales
    fallback: str                # the op's name for the layer's own vLLM apply


def _sizes(layer: Any) -> tuple[int, int] | None:
    """(N, K) of a vLLM linear layer: its logical widths' sum and input size per partition."""
    widths, k = getattr(layer, "logical_widths", None), getattr(layer, "input_size_per_partition", None)
    if not widths or not isinstance(k, int):
        return None
    return int(sum(widths)), k


def layout_of(method: Any, layer: Any) -> Fp8Layout | str:
    """The layer's Fp8Layout, or why the op cannot take it as stored."""
    sizes, w = _sizes(layer), getattr(layer, "weight", None)
    if sizes is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != FP8:
        return "not a 2-D float8_e4m3fn weight with logical widths"
    n, k = sizes
    block = getattr(layer, "weight_block_size", None)
    scale_attr = "weight_scale_inv" if getattr(layer, "weight_scale_inv", None) is not None else "weight_scale"
    scale = getattr(layer, scale_attr, None)
    if block:
        kn = False
        if w.stride(1) != 1 or w.shape[0] < n or w.shape[1] < k:
            return f"block weight {tuple(w.shape)} strides {w.stride()}: not [N, K] row-major"
    else:
        kn = True
        if w.stride(0) != 1 or w.shape[0] < k or w.shape[1] < n:
            return f"weight {tuple(w.shape)} strides {w.stride()}: not the [K, N] view of [N, K] rows"
    view = op_fp8.nk_view(w, n, k, kn)
    if k % VEC or view.stride(0) % VEC or view.data_ptr() % 16:
        return f"weight rows not whole 16-byte vectors (K={k}, row stride {view.stride(0)})"
    if not isinstance(scale, torch.Tensor):
        return f"no {scale_attr}"
    mode = scale_layout(scale, n, k, tuple(block) if block else None)
    if isinstance(mode, str):
        return mode
    out_dtype = getattr(method, "out_dtype", None)
    if out_dtype not in DTYPES:
        return f"output dtype {out_dtype}"
    bn, bk = (int(block[0]), int(block[1])) if block else (0, 0)
    return Fp8Layout(n, k, kn, bn, bk, scale_attr, fp8_key(block and (bn, bk), mode[0] == SCALE_CHANNEL), "")


def tabled(layout: Fp8Layout, device: torch.device) -> bool:
    """Whether a tuned table lists the layer's shape and format on this device (any bucket)."""
    return bool(load_table(layout.n, layout.k, layout.fmt, device_facts(device)[0]))


class Fp8DenseHook:
    """The wrappers of the FP8 linear methods, and the weights warmed so far."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._warmed: set[op_fp8.ShapeKey] = set()
        self._reported: set[op_fp8.ShapeKey] = set()
        self.skipped: dict[str, str] = {}        # layer -> why vLLM serves it entirely
        self._skips_reported = 0                 # how many of skipped's entries were logged

    def install(self) -> list[str]:
        """Wrap each method's load and apply (once); the names of what was wrapped."""
        if vc.batch_invariant():
            self.logger.info("moe-serve FP8 dense GEMV: off, VLLM_BATCH_INVARIANT is set")
            return []
        done = []
        for where, apply_name in METHODS:
            cls = vc.load(where)
            if vc.wrap_method(cls, LOAD, functools.partial(self._load, apply_name)):
                done.append(f"{where[1]}.{LOAD}")
            if vc.wrap_method(cls, apply_name, self._apply):
                done.append(f"{where[1]}.{apply_name}")
        return done

    def _load(self, apply_name: str, orig: Callable) -> Callable:
        """make() for process_weights_after_loading(self, layer): vLLM's, then the layer's mark."""
        def process_weights_after_loading(method: Any, layer: Any) -> Any:
            result = orig(method, layer)
            self.mark(method, layer, apply_name)
            return result
        return process_weights_after_loading

    def mark(self, method: Any, layer: Any, apply_name: str) -> Fp8Layout | None:
        """Read the layer's stored layout; mark it (with its vLLM apply registered as the op's
        fallback) where the op can take it and a table lists it, else record why not."""
        name = str(getattr(layer, "prefix", "") or f"layer@{id(layer):x}")
        layout = layout_of(method, layer)
        if not isinstance(layout, str) and not (op_fp8.UNTUNED_TOO or tabled(layout, layer.weight.device)):
            layout = "no tuned table lists its shape and format for this GPU (`moe-serve tune --model DIR`)"
        if isinstance(layout, str):
            self.skipped[name] = layout
            setattr(layer, MARK, None)
            return None
        vllm_apply = getattr(type(method), apply_name)
        vllm_apply = getattr(vllm_apply, "__wrapped__", vllm_apply)
        key = op_fp8.register_fallback(f"fp8:{name}", functools.partial(vllm_apply, method, layer))
        layout = layout._replace(fallback=key)
        setattr(layer, MARK, layout)
        return layout

    def _apply(self, orig: Callable) -> Callable:
        """make() for apply(self, layer, x, bias=None) / apply_weights: a marked layer's float x
        -> the op (traced whole by torch.compile: reads only constants, dtypes and shapes)."""
        def apply(method: Any, layer: Any, x: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
            lay = getattr(layer, MARK, None)
            if (lay is not None and isinstance(x, torch.Tensor) and x.dtype == method.out_dtype
                    and x.shape[-1] == lay.k and op_fp8.runs_here(x)
                    and (bias is None or (tuple(bias.shape) == (lay.n,) and bias.dtype == x.dtype))):
                block = (lay.block_n, lay.block_k) if lay.block_n else None
                return op_fp8.fp8_dense_linear(x, layer.weight, getattr(layer, lay.scale_attr), bias, lay.n,
                                               lay.weight_kn, block, lay.fallback)
            return orig(method, layer, x, bias)
        return apply

    def warm_pending(self) -> int:
        """Compile the kernel variants (M = 1..16) of every weight the op has seen and not yet
        warmed, and log (once each) the weights whose small calls the data's layout sent to vLLM;
        returns how many weights were warmed. Layers vLLM serves entirely (skipped) are logged too,
        once per reason with their count and a first name: a switch that takes no layer says so."""
        self._report_skipped()
        for key, why in op_fp8.fallbacks().items():
            if key not in self._reported:
                self._reported.add(key)
                self.logger.warning("moe-serve FP8 dense GEMV: weight [%d, %d] %s ran vLLM's at <= %d tokens: %s",
                                    key[0], key[1], key[2], op_fp8.MAX_M, why)
        done = 0
        for key, entry in op_fp8.seen().items():
            if key in self._warmed:
                continue
            n = op_fp8.warm_variants(entry)
            self._warmed.add(key)
            self.logger.info("moe-serve FP8 dense GEMV: weight %s %s: %d variants warmed for M = 1..%d",
                             list(entry.weight.shape), key[2], n, op_fp8.MAX_M)
            done += 1
        return done

    def _report_skipped(self) -> None:
        """Log the layers skipped since the last report, grouped by why."""
        new = list(self.skipped.items())[self._skips_reported:]
        self._skips_reported = len(self.skipped)
        by_reason: dict[str, list[str]] = {}
        for name, why in new:
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            self.logger.warning("moe-serve FP8 dense GEMV: %d FP8 linear layer(s) left to vLLM at every M (%s%s): %s",
                                len(names), names[0], ", ..." if len(names) > 1 else "", why)


_hook: Fp8DenseHook | None = None


def install(plugin_config: PluginConfig, logger: logging.Logger | None = None) -> list[str]:
    """With the fp8_dense_gemv setting on in optimized mode: wrap vLLM's FP8 linear methods
    (once per process); the names of what was wrapped ([] when off)."""
    global _hook
    if plugin_config.mode != "optimized" or not plugin_config.fp8_dense_gemv:
        return []
    if _hook is None:
        _hook = Fp8DenseHook(logger or logging.getLogger(__name__))
    return _hook.install()


def warm_pending() -> int:
    """Fp8DenseHook.warm_pending of the installed hook (0 when none is)."""
    return _hook.warm_pending() if _hook is not None else 0
