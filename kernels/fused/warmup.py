"""Compile every kernel variant the fused ops launch for the call kinds they have seen (vLLM's
profile run passes each layer once), before vLLM captures its CUDA graphs: vLLM captures each
batch size without a warm-up run, so a first launch there would compile inside the capture.

warm_pending() runs each distinct variant once on zero inputs (fused_norm_linear at the M of
1..SERVED_MAX_M its tuned table lists: where the op runs the fused kernel;
fused_qk_norm_rope at one token: its variants do not depend on M) and remembers what it warmed.
"""
from __future__ import annotations

from typing import Any

import torch

from moe_serve.kernels.fused import norm_gemv as ng
from moe_serve.kernels.fused import ops
from moe_serve.kernels.fused import qk_norm_rope as qk
from moe_serve.kernels.moe.launch import record_launches

_warmed: set[Any] = set()


def warm_norm_gemv(weight: torch.Tensor, norm_weight: torch.Tensor, bias: torch.Tensor | None, residual: bool,
                   write_h: bool, max_m: int = ng.SERVED_MAX_M) -> int:
    """Run each distinct norm_gemv variant of this call kind once on zeros, at the M of 1..max_m
    its tuned table lists (ng.tuned_config); the number of distinct variants."""
    keys: set[tuple] = set()
    N, K = weight.shape
    for M in range(1, max_m + 1):
        cfg = ng.tuned_config(M, N, K, weight.dtype, weight.device)     # what the op serves M with
        if cfg is None:
            continue
        x = torch.zeros((M, K), dtype=weight.dtype, device=weight.device)
        r = torch.zeros_like(x) if residual else None
        with record_launches() as launches:
            ng.norm_gemv(x, r, norm_weight, 1e-6, weight, bias, write_h, cfg=cfg, exact_h=ng.SERVED_EXACT_H)
        key = tuple(sorted(launches[0][3].items()))         # the variant: its constexprs
        if key not in keys:
            keys.add(key)
            ng.norm_gemv(x, r, norm_weight, 1e-6, weight, bias, write_h, cfg=cfg, exact_h=ng.SERVED_EXACT_H)
    return len(keys)


def warm_pending() -> int:
    """Warm every call kind the ops have seen on a device our kernels run on and not yet warmed;
    returns how many call kinds were warmed."""
    done = 0
    for key, (weight, norm_weight, bias) in ops.seen_norm_linear().items():
        if key in _warmed or not ops.runs_here(weight):
            continue
        warm_norm_gemv(weight, norm_weight, bias, residual=key[4], write_h=key[5])
        _warmed.add(key)
        done += 1
    for key, (qw, kw, cos_sin, eps) in ops.seen_qk_norm_rope().items():
        if key in _warmed or not ops.runs_here(qw):
            continue
        row, dtype, pos_dtype, hq, hkv, d, rot, neox, _ = key
        qkv = torch.zeros((1, row), dtype=dtype, device=qw.device)
        qk.qk_norm_rope(qkv, torch.zeros(1, dtype=pos_dtype, device=qw.device), qw, kw, eps, cos_sin, hq, hkv, d,
                        rot, neox, out=torch.empty((1, (hq + hkv) * d), dtype=dtype, device=qw.device))
        _warmed.add(key)
        done += 1
    return done
