"""Residual add + RMSNorm over rows, one launch: the unfused half of the fused norm ops where the
GEMV prologue does not serve (more than norm_gemv.MAX_M tokens: prefill), in vLLM's semantics
(moe_serve.kernels.fused.norm_gemv's module doc; vllm.ir.ops.layernorm):

    s = x + residual (fp32); residual_out = s in x's dtype; h = rnd(rnd(s * rstd) * w)

add_rms_norm_kernel   grid (M,)
    One program per token: a pass over the row for the sum of squares, a second (from L1/L2)
    storing residual_out and h. Any M, any K.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.fused.norm_gemv import TL_DTYPES
from moe_serve.kernels.moe.launch import jit, launch

BLOCK = 1024                        # columns per step


@jit()
def add_rms_norm_kernel(
    # pointers: x, residual [M, K] (residual unused without HAS_RESIDUAL), weight [K]; outputs
    # h and residual_out [M, K] (residual_out unused without HAS_RESIDUAL); rows contiguous
    x_ptr, r_ptr, w_ptr, h_ptr, ro_ptr,
    # sizes, the norm's epsilon
    K, eps,
    # meta
    HAS_RESIDUAL: tl.constexpr, DT: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * K
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        s = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(r_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ro_ptr + row + offs, s.to(DT), mask=mask)
        ss += s * s
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        s = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(r_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row + offs, ((s * rstd).to(DT).to(tl.float32) * w).to(DT), mask=mask)


def unsupported(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> str | None:
    """None when add_rms_norm takes the call, else why not: x, residual [M, K] and weight [K],
    contiguous, one dtype of TL_DTYPES, one device."""
    if x.dim() != 2 or tuple(weight.shape) != (x.shape[1],) or (
            residual is not None and residual.shape != x.shape):
        return f"shapes: x {tuple(x.shape)}, residual and weight {tuple(weight.shape)} must be [M, K], [M, K], [K]"
    tensors = [t for t in (x, residual, weight) if t is not None]
    if x.dtype not in TL_DTYPES or any(t.dtype != x.dtype or not t.is_contiguous() for t in tensors):
        return "layout: contiguous tensors of one dtype (bf16, fp16, fp32)"
    if any(t.device != x.device for t in tensors):
        return "device: the tensors are on different devices"
    return None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [M, K], residual_out [M, K] or None without a residual) for x, residual [M, K] and the
    norm's weight [K] (see unsupported; ValueError otherwise). Fresh outputs (x and residual are
    left as they are), one launch."""
    why = unsupported(x, residual, weight)
    if why is not None:
        raise ValueError(f"add_rms_norm: {why}")
    M, K = x.shape
    h = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if M:
        launch(add_rms_norm_kernel, (M,), x, residual if residual is not None else x, weight, h,
               res_out if res_out is not None else h, K, float(eps), HAS_RESIDUAL=residual is not None,
               DT=TL_DTYPES[x.dtype], BLOCK_K=min(BLOCK, triton.next_power_of_2(K)), num_warps=4)
    return h, res_out
