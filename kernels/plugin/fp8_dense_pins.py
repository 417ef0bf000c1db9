"""The pins of kernels/plugin/fp8_dense_hook.py on vLLM's FP8 linear internals (0.26 and 0.32), in
kernels/plugin/vllm_pins.py's form: each checks what the hook relies on and returns what it
checked, or raises. PINS is meant to join vllm_pins.PINS (the plugin then installs no hook where
one fails). The stored layouts themselves are checked again per layer at load (layout_of), so a
layout these pins cannot see refuses that layer instead of misreading it.
"""
from __future__ import annotations

import inspect
from typing import Callable

from moe_serve.kernels.plugin.fp8_dense_hook import CT_FP8, FP8_LINEAR, LOAD, METHODS
from moe_serve.kernels.plugin.vllm_compat import load

APPLY_PARAMS = ("self", "layer", "x", "bias")
BLOCK_KERNELS = "vllm.model_executor.kernels.linear.scaled_mm"


def _params(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


def _src(fn: Callable) -> str:
    return inspect.getsource(inspect.unwrap(fn))


def pin_fp8_linear_methods() -> str:
    """Both methods: apply(self, layer, x, bias) is the layer's whole FP8 GEMM (one call into the
    kernel vLLM chose), process_weights_after_loading(self, layer) finishes the weights, the
    output dtype is self.out_dtype, the layer records its logical widths (N) and weight block
    size, and the block scale's name (weight_scale_inv for Fp8LinearMethod, weight_scale for
    compressed-tensors); CompressedTensorsLinearMethod calls the scheme's apply_weights."""
    for where, apply_name in METHODS:
        cls = load(where)
        assert _params(getattr(cls, apply_name)) == APPLY_PARAMS, where
        assert _params(getattr(cls, LOAD)) == ("self", "layer"), where
        assert "return self.fp8_linear.apply_weights(layer, x, bias)" in _src(getattr(cls, apply_name)), where
        assert "self.out_dtype = torch.get_default_dtype()" in _src(cls.__init__), where
        create = _src(cls.create_weights)
        assert "layer.logical_widths = output_partition_sizes" in create, where
        assert "layer.weight_block_size = self.weight_block_size" in create, where
    assert 'layer.register_parameter("weight_scale_inv", scale)' in _src(load(FP8_LINEAR).create_weights)
    assert 'layer.register_parameter("weight_scale", weight_scale)' in _src(load(CT_FP8).create_weights)
    ct_method = load(("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
                      "CompressedTensorsLinearMethod"))
    assert "scheme.apply_weights(layer, x, bias=bias)" in _src(ct_method.apply)
    for name in ("ColumnParallelLinear", "RowParallelLinear"):
        cls = load(("vllm.model_executor.layers.linear", name))
        assert "self.input_size_per_partition = " in _src(cls.__init__), name
    return "Fp8LinearMethod / CompressedTensorsW8A8Fp8 apply, load, out_dtype, logical widths, scale names"


def pin_fp8_block_layout() -> str:
    """Block FP8 weights stay [N, K] row-major: vLLM's block strategy transposes nothing, and its
    Hopper GEMMs (CUTLASS, DeepGEMM) read B as [N, K] rows."""
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    assert ".t()" not in _src(fp8_utils.process_fp8_weight_block_strategy)
    cutlass = load((f"{BLOCK_KERNELS}.cutlass", "CutlassFp8BlockScaledMMKernel"))
    assert "B.T," in _src(cutlass.apply_block_scaled_mm)
    deep_gemm = load((f"{BLOCK_KERNELS}.deep_gemm", "DeepGemmFp8BlockScaledMMKernel"))
    assert "(A.shape[0], B.shape[0])" in _src(deep_gemm.apply_block_scaled_mm)
    return "block FP8 weights [N, K] (block strategy, CUTLASS and DeepGEMM block GEMMs)"


PINS: tuple[Callable[[], str], ...] = (pin_fp8_linear_methods, pin_fp8_block_layout)
