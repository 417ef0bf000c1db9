"""The dense decode GEMV as a torch custom op, ``torch.ops.moe_serve.dense_linear(x, weight,
bias)``: F.linear's result for any input, computed by moe_serve.kernels.dense.gemv where M (the rows of x
[..., K]) is 1..MAX_M on CUDA, the layout is one the kernel takes and a tuned table lists the
weight's shape and M's bucket for this device (serving_config: measured
faster than F.linear there), else by F.linear.

Why an op: vLLM compiles the model with torch.compile (Inductor) and replays it from CUDA
graphs. A registered op with a fake implementation is one opaque node of the traced graph,
whatever M the graph is traced with, and its implementation decides per call (at capture, for a
captured batch size), so one graph serves decode batches (ours) and prefill (F.linear).

Every [N, K] weight that reaches the op with a layout the kernel takes is remembered
(`seen`, with the tensors) so that a worker can compile its kernel variants before serving
(warm_variants: the M in 1..MAX_M it serves); a weight whose call at 1..MAX_M tokens still went to F.linear
(x misaligned or strided) is remembered with the reason (`fallbacks`). On CPU tensors the op is F.linear, unless a test sets
CPU_INTERPRETER under TRITON_INTERPRET=1 (the kernel then runs in Triton's interpreter).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from moe_serve.kernels.dense.configs import Config, config_for, tuned_config
from moe_serve.kernels.dense.gemv import DTYPES, MAX_M, dense_gemv, device_facts, unsupported
from moe_serve.kernels.moe.launch import record_launches

NAMESPACE, NAME = "moe_serve", "dense_linear"
CPU_INTERPRETER = False     # test-only: our kernel on CPU tensors under TRITON_INTERPRET=1
UNTUNED_TOO = False         # test-only: the heuristic's config also where no table lists the bucket

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define(f"{NAME}(Tensor x, Tensor weight, Tensor? bias) -> Tensor")

ShapeKey = tuple[int, int, torch.dtype, bool, str]   # (N, K, dtype, has bias, device)
_seen: dict[ShapeKey, tuple[torch.Tensor, torch.Tensor | None]] = {}
_fallbacks: dict[ShapeKey, str] = {}                  # F.linear at 1..MAX_M tokens: the first reason


def runs_here(x: torch.Tensor) -> bool:
    """Whether our kernel may run on x's device: CUDA, or the CPU under the interpreter when a
    test asked for it."""
    if x.is_cuda:
        return True
    return CPU_INTERPRETER and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def serving_config(M: int, weight: torch.Tensor) -> Config | None:
    """The config our kernel runs for M tokens of this weight (a dtype of DTYPES): the tuned
    table's for M's bucket on this device, or None where no table lists it (F.linear was measured
    as fast or faster there); with UNTUNED_TOO the heuristic's instead of None."""
    (N, K), dtype = weight.shape, DTYPES[weight.dtype]
    device, sms = device_facts(weight.device)
    cfg = tuned_config(M, N, K, dtype, device)
    return config_for(M, N, K, dtype, device, sms) if cfg is None and UNTUNED_TOO else cfg


def static_support(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What can be known without the data pointers (at trace time, too): a 2-D weight of one of
    the kernel's dtypes, x of the same dtype and device (one where the kernel runs), unit
    stride along K, K a whole number of 16-byte vectors, bias none or [N] of the weight's dtype."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in DTYPES:
        return False
    if x.dtype != weight.dtype or x.device != weight.device or not runs_here(x):
        return False
    K = weight.shape[1]
    vec = 16 // (4 if weight.dtype == torch.float32 else 2)
    if x.shape[-1] != K or K % vec or weight.stride(1) != 1 or weight.stride(0) % vec:
        return False
    return bias is None or (tuple(bias.shape) == (weight.shape[0],) and bias.dtype == weight.dtype)


def _impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), by our kernel where it takes the call."""
    if static_support(x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None, str(weight.device))
        if key not in _seen:
            _seen[key] = (weight, bias)
        cfg = serving_config(x2.shape[0], weight) if x2.shape[0] <= MAX_M else None
        if cfg is not None:
            why = unsupported(x2, weight, bias)
            if why is None:
                return dense_gemv(x2, weight, bias, cfg=cfg).reshape(*x.shape[:-1], weight.shape[0])
            _fallbacks.setdefault(key, why)
    return F.linear(x, weight, bias)


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_lib.impl(NAME, _impl, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::{NAME}", _fake, lib=_lib)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.ops.moe_serve.dense_linear: F.linear(x [..., K], weight [N, K], bias [N]) -> [..., N]."""
    return torch.ops.moe_serve.dense_linear(x, weight, bias)


def seen() -> dict[ShapeKey, tuple[torch.Tensor, torch.Tensor | None]]:
    """The weights (and biases) the op has seen, by shape key, in the order first seen."""
    return dict(_seen)


def fallbacks() -> dict[ShapeKey, str]:
    """Weights the op sent to F.linear at 1..MAX_M tokens for a layout only the data rules out
    (x's alignment or contiguity), with the first reason."""
    return dict(_fallbacks)


def warm_variants(weight: torch.Tensor, bias: torch.Tensor | None, max_m: int = MAX_M) -> int:
    """Compile every kernel variant the op launches for this weight at M = 1..max_m (the M it
    serves): record each M's launch and run the first M of each distinct variant on zero inputs.
    Returns the number of distinct variants (0: F.linear at every M)."""
    seen_keys: set[tuple[Any, ...]] = set()
    K = weight.shape[1]
    for M in range(1, max_m + 1):
        cfg = serving_config(M, weight)
        if cfg is None:
            continue
        x = torch.zeros((M, K), dtype=weight.dtype, device=weight.device)
        with record_launches() as launches:
            dense_gemv(x, weight, bias, cfg=cfg)
        key = tuple(sorted(launches[0][3].items()))
        if key in seen_keys:
            continue
        seen_keys.add(key)
        dense_gemv(x, weight, bias, cfg=cfg)
    return len(seen_keys)
