"""The FP8 dense decode GEMV as a torch custom op, ``torch.ops.moe_serve.fp8_dense_linear(x,
weight, weight_scale, bias, out_features, weight_kn, block_n, block_k, fallback)``: an FP8 linear
layer's output for any M, taking the weight and its scale as vLLM stores them.

    weight        float8_e4m3fn, either [N', K'] row-major (weight_kn false: vLLM's block FP8) or
                  [K', N'] with unit stride along K (weight_kn true: the transposed view vLLM's
                  per-tensor / per-channel CUTLASS path keeps), N' >= out_features = N and
                  K' >= K = x's last dim (CUTLASS pads both to 16): the op reads the [N, K] view
                  weight(.t())[:N, :K], no copy.
    weight_scale  float32: one value, [N'] / [N', 1] per channel, or with block_n, block_k > 0
                  the [cdiv(N, block_n), cdiv(K, block_k)] block scales (any strides).

At 1..MAX_M tokens on CUDA, where a tuned table (kernels/dense/configs/) lists the shape's format
and M's bucket for the GPU (serving_config: measured faster than vLLM's FP8 linear there), the
result is moe_serve.kernels.dense.gemv_fp8's (W8A16: x is not quantized); everywhere else the op calls
the layer's own vLLM apply registered under `fallback` (register_fallback; kernels/plugin/
fp8_dense_hook.py registers each layer at load), and with no fallback (direct calls, the CPU) it
is F.linear of x on the weights dequantized in fp32 (dequantize). As for
torch.ops.moe_serve.dense_linear, the op is one opaque node of vLLM's compiled graph that
decides per call, so one graph serves decode (ours) and everything else (vLLM's FP8 GEMM, run
eagerly from inside the op: for prefill and for decode batches above 16 tokens, vLLM's activation
quantization then runs as its own launches, without the compiled graph's fusions -- what that
costs at c > 16 is for the GPU to measure, fp8_dense_gemv on against off).

Every weight that reaches the op at 1..MAX_M tokens with a layout the kernel takes is remembered
(`seen`) so that a worker can compile its variants before serving (warm_variants); one whose call
still went elsewhere for a layout only the data rules out is remembered with the reason
(`fallbacks`). On CPU tensors the kernel runs only when a test sets CPU_INTERPRETER under
TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from moe_serve.kernels.dense.configs import Config, config_for, fp8_key, tuned_config
from moe_serve.kernels.dense.gemv import DTYPES, device_facts
from moe_serve.kernels.dense.gemv_fp8 import FP8, MAX_M, dense_gemv_fp8, unsupported
from moe_serve.kernels.moe.launch import record_launches

NAMESPACE, NAME = "moe_serve", "fp8_dense_linear"
CPU_INTERPRETER = False     # test-only: our kernel on CPU tensors under TRITON_INTERPRET=1
UNTUNED_TOO = False         # test-only: the heuristic's config also where no table lists the bucket

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define(f"{NAME}(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int out_features, "
            f"bool weight_kn, int block_n, int block_k, str fallback) -> Tensor")

Fallback = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
_fallback_fns: dict[str, Fallback] = {}


class Fp8Weight(NamedTuple):
    """A weight the op has seen: its [N, K] view, scale, block and bias."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None
    bias: torch.Tensor | None
    x_dtype: torch.dtype


ShapeKey = tuple[int, int, str, torch.dtype, bool, str]   # (N, K, format key, x dtype, bias, device)
_seen: dict[ShapeKey, Fp8Weight] = {}
_fallbacks: dict[ShapeKey, str] = {}                         # not ours at 1..MAX_M: the first reason


def register_fallback(name: str, fn: Fallback) -> str:
    """Make fn(x, bias) the op's result where our kernel does not serve a call naming `name`
    (the layer's own vLLM apply); returns name."""
    if not name:
        raise ValueError("a fallback needs a non-empty name ('' is the dequantized F.linear)")
    _fallback_fns[name] = fn
    return name


def runs_here(x: torch.Tensor) -> bool:
    """Whether our kernel may run on x's device: CUDA, or the CPU under the interpreter when a
    test asked for it."""
    if x.is_cuda:
        return True
    return CPU_INTERPRETER and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def nk_view(weight: torch.Tensor, out_features: int, K: int, weight_kn: bool) -> torch.Tensor:
    """The [N, K] view of a stored weight (see the module doc)."""
    return (weight.t() if weight_kn else weight)[:out_features, :K]


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] (dtype) of fp8 w [N, K] times its scale (one value, per channel [N'] / [N', 1], or
    per [bn, bk] block; partial blocks at the edges)."""
    N, K = w.shape
    s = scale.to(dtype)
    if block:
        bn, bk = block
        s = s[:-(-N // bn), :-(-K // bk)].repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]
    elif s.numel() > 1:
        s = s.reshape(-1)[:N, None]
    return w.to(dtype) * s


def serving_config(M: int, N: int, K: int, fmt: str, device: torch.device) -> Config | None:
    """The config our kernel runs for M tokens of an [N, K] weight of format key fmt: the tuned
    table's for M's bucket on this device, or None where no table lists it (vLLM's FP8 linear
    was as fast or faster there); with UNTUNED_TOO the heuristic's instead of None."""
    name, sms = device_facts(device)
    cfg = tuned_config(M, N, K, fmt, name)
    return config_for(M, N, K, fmt, name, sms) if cfg is None and UNTUNED_TOO else cfg


def _impl(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
          out_features: int, weight_kn: bool, block_n: int, block_k: int, fallback: str) -> torch.Tensor:
    """The layer's output (see the module doc)."""
    K = x.shape[-1]
    w = nk_view(weight, out_features, K, weight_kn)
    block = (block_n, block_k) if block_n > 0 else None
    x2 = x.reshape(-1, K)
    if x2.shape[0] <= MAX_M and runs_here(x) and x.dtype in DTYPES and w.dtype == FP8:
        fmt = fp8_key(block, block is None and weight_scale.numel() > 1)
        key = (out_features, K, fmt, x.dtype, bias is not None, str(x.device))
        if key not in _seen:
            _seen[key] = Fp8Weight(w, weight_scale, block, bias, x.dtype)
        cfg = serving_config(x2.shape[0], out_features, K, fmt, x.device)
        if cfg is not None:
            why = unsupported(x2, w, weight_scale, bias, block)
            if why is None:
                y = dense_gemv_fp8(x2, w, weight_scale, bias, block, cfg=cfg)
                return y.reshape(*x.shape[:-1], out_features)
            _fallbacks.setdefault(key, why)
    if fallback:
        return _fallback_fns[fallback](x, bias)
    y = F.linear(x.float(), dequantize(w, weight_scale, block), None if bias is None else bias.float())
    return y.to(x.dtype)


def _fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
          out_features: int, weight_kn: bool, block_n: int, block_k: int, fallback: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_lib.impl(NAME, _impl, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::{NAME}", _fake, lib=_lib)


def fp8_dense_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int, weight_kn: bool = False, block: tuple[int, int] | None = None,
                     fallback: str = "") -> torch.Tensor:
    """torch.ops.moe_serve.fp8_dense_linear: x [..., K] through the FP8 weight as stored -> [..., N]
    in x's dtype (see the module doc)."""
    bn, bk = block or (0, 0)
    return torch.ops.moe_serve.fp8_dense_linear(x, weight, weight_scale, bias, out_features, weight_kn,
                                                bn, bk, fallback)


def seen() -> dict[ShapeKey, Fp8Weight]:
    """The weights the op has seen at 1..MAX_M tokens, by shape key, in the order first seen."""
    return dict(_seen)


def fallbacks() -> dict[ShapeKey, str]:
    """Weights whose calls at 1..MAX_M tokens a table gave to our kernel but the data's layout
    (x's alignment or contiguity, the scale's) sent elsewhere, with the first reason."""
    return dict(_fallbacks)


def warm_variants(entry: Fp8Weight, max_m: int = MAX_M) -> int:
    """Compile every kernel variant the op launches for this weight at M = 1..max_m (the M it
    serves): record each M's launch and run the first M of each distinct variant on zero inputs.
    Returns the number of distinct variants (0: vLLM's at every M)."""
    keys: set[tuple[Any, ...]] = set()
    N, K = entry.weight.shape
    fmt = fp8_key(entry.block, entry.block is None and entry.scale.numel() > 1)
    for M in range(1, max_m + 1):
        cfg = serving_config(M, N, K, fmt, entry.weight.device)
        if cfg is None:
            continue
        x = torch.zeros((M, K), dtype=entry.x_dtype, device=entry.weight.device)
        with record_launches() as launches:
            dense_gemv_fp8(x, entry.weight, entry.scale, entry.bias, entry.block, cfg=cfg)
        key = tuple(sorted(launches[0][3].items()))
        if key in keys:
            continue
        keys.add(key)
        dense_gemv_fp8(x, entry.weight, entry.scale, entry.bias, entry.block, cfg=cfg)
    return len(keys)
