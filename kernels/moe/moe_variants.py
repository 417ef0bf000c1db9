"""Warm up moe-serve's fused-MoE kernels: compile every variant serving can hit, ahead of time.

Variants = one per distinct (kernel, constexprs, argument dtypes) over the config of every
M bucket up to max_tokens. With every run-time-varying int in do_not_specialize, M itself
never causes a compile, so after warm_moe_variants() serving compiles nothing.
(The plugin's per-layer warm-up is kernels/plugin/layer_warmup.py; the HTTP start-up warm-up is
service/warmup.py.)
"""
from __future__ import annotations

import sys
import time
from typing import Any

import torch

from moe_serve.kernels.moe import configs, quant_format, selection
from moe_serve.kernels.moe.aot import compile_launches
from moe_serve.kernels.moe.fused_moe import FP8, Fp8Scales, dtype_name, fused_moe
from moe_serve.kernels.moe.launch import kernel_name, record_launches


def _variant_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    dtypes = tuple(str(a.dtype) if isinstance(a, torch.Tensor) else None for a in args)
    return (kernel_name(kernel), tuple(sorted(kwargs.items())), dtypes)


def _inputs(M: int, E: int, N: int, K: int, topk: int, dtype: torch.dtype, fp8: str | None,
            static_act: bool, ids_dtype: torch.dtype, device: str, per_token_act: bool = False,
            block_shape: tuple[int, int] | None = None) -> tuple:
    wdt = FP8 if fp8 else dtype
    x = torch.randn(M, K, device=device).to(dtype)
    w1 = torch.empty(E, 2 * N, K, device=device, dtype=wdt)
    w2 = torch.empty(E, K, N, device=device, dtype=wdt)
    w1.copy_(torch.randn(E, 2 * N, K, device=device) * 0.02)
    w2.copy_(torch.randn(E, K, N, device=device) * 0.02)
    ids = (torch.arange(M * topk, device=device) % E).reshape(M, topk).to(ids_dtype)
    tw = torch.full((M, topk), 1.0 / topk, device=device)
    scales = None
    if fp8:
        one = lambda *s: torch.full(s, 1.0, device=device)  # noqa: E731
        x_fp8 = dtype == FP8
        if block_shape:
            bn, bk = block_shape
            scales = Fp8Scales(one(E, -(-2 * N // bn), -(-K // bk)), one(E, -(-K // bn), -(-N // bk)),
                               one(M, -(-K // bk)) if x_fp8 else None, block_shape=block_shape)
        else:
            per_ch = fp8 == "per_channel"
            static = static_act and not per_token_act
            a1 = one(M, 1) if per_token_act and x_fp8 else one() if static else None
            scales = Fp8Scales(one(E, 2 * N) if per_ch else one(E), one(E, K) if per_ch else one(E),
                               a1, one() if static else None, per_token_act=per_token_act)
    return x, w1, w2, tw, ids, scales


def warm_moe_variants(E: int, N: int, K: int, topk: int, dtype: torch.dtype, max_tokens: int,
           fp8: str | None = None, device: str | torch.device = "cuda", *,
           static_act: bool = False, router_weight_on_input: bool = False,
           ids_dtypes: tuple[torch.dtype, ...] = (torch.int32,), compile_only: bool = False,
           verbose: bool = True, per_token_act: bool = False,
           block_shape: tuple[int, int] | None = None) -> int:
    """Compile all variants for one MoE layer shape (E experts, hidden K, per-rank N, topk).

    dtype: activation dtype (bf16/fp16/fp32, or fp8: hidden states quantized by vLLM, with
    their scales); fp8: None | 'per_tensor' | 'per_channel' | 'block' (W8A8 weights; with
    block_shape (bn, bk) the block format); activations static if static_act, dynamic per
    token if per_token_act (FP8-dynamic), else dynamic (per token group for block).
    compile_only: record the launches and compile them for sm_90 via moe_serve.kernels.moe.aot (no GPU
    needed) instead of running them. Returns the number of distinct variants.
    """
    device = str(device)
    if block_shape:
        wname = quant_format.block_key(*block_shape)
    else:
        wname = quant_format.PER_TOKEN if per_token_act else "fp8" if fp8 else dtype_name(dtype)
    buckets = selection.buckets_for(E, N, K, wname)
    reach = sorted({configs.bucket_of(m, buckets) for m in
                    list(range(1, min(max_tokens, buckets[-1]) + 1)) + [max_tokens]})
    variants: set[tuple] = set()
    t0 = time.perf_counter()
    for i, b in enumerate(reach):
        M = min(b, max_tokens)
        for ids_dtype in ids_dtypes:
            args = _inputs(M, E, N, K, topk, dtype, fp8, static_act, ids_dtype, device,
                           per_token_act, block_shape)
            x, w1, w2, tw, ids, scales = args
            if router_weight_on_input:
                ids, tw = ids[:, :1].contiguous(), tw[:, :1].contiguous()
            with record_launches() as launches:
                fused_moe(x, w1, w2, tw, ids, fp8=scales,
                          apply_router_weight_on_input=router_weight_on_input)
            new = [ln for ln in launches if _variant_key(ln[0], ln[2], ln[3]) not in variants]
            variants.update(_variant_key(ln[0], ln[2], ln[3]) for ln in launches)
            if compile_only:
                compile_launches(new)
            else:
                fused_moe(x, w1, w2, tw, ids, fp8=scales,
                          apply_router_weight_on_input=router_weight_on_input)
        if verbose:
            print(f"[moe warmup] E={E} N={N} K={K} {wname}{'/' + fp8 if fp8 else ''}: bucket "
                  f"{b} ({i + 1}/{len(reach)}), {len(variants)} variants, "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return len(variants)
