"""The fused pieces as torch custom ops (namespace moe_serve, beside dense_linear), so that
torch.compile traces each as one opaque node (a fake implementation gives its output shapes)
and CUDA graphs capture its launch; the implementation decides per call (at capture, for a
captured batch size):

``fused_norm_linear(x, residual?, norm_weight, eps, weight, bias?, write_h) -> (y, residual_out, h)``
    residual add + RMSNorm + F.linear (moe_serve.kernels.fused.norm_gemv at 1..SERVED_MAX_M (16) tokens on
    CUDA where its tuned table lists the token block: measured faster than the chain; else the
    row-norm kernel moe_serve.kernels.fused.rms_norm, then the GEMM the unfused layer runs: dense_linear, our
    GEMV where its table lists the shape, under the dense_gemv setting; else F.linear).
    residual_out is empty without a residual (the caller keeps x, as vLLM's layer does), h empty
    unless write_h.
``fused_qk_norm_rope(qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache,
num_q_heads, num_kv_heads, head_dim, rot_dim, neox) -> qk``
    the q | k heads [T, (Hq + Hkv) * D] of qkv normalised and rotated (moe_serve.kernels.fused.qk_norm_rope
    on CUDA, any T); qkv is not written.
``fused_qk_norm_rope_cache(..., key_cache!, value_cache!, slot_mapping) -> qk``
    the same, also writing K and V into the paged cache (mutates the two caches).

Everywhere our kernels do not run (the CPU engine; layouts a kernel refuses) each op computes
the unfused composition in torch with vLLM's semantics (moe_serve.kernels.fused.reference), so a model
calling them runs on vLLM's CPU engine unchanged. CPU_INTERPRETER (tests only, under
TRITON_INTERPRET=1) runs the kernels on CPU tensors instead.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from moe_serve.kernels.config import current
from moe_serve.kernels.dense.configs import Config
from moe_serve.kernels.dense.op import dense_linear
from moe_serve.kernels.fused import norm_gemv as ng
from moe_serve.kernels.fused import qk_norm_rope as qk
from moe_serve.kernels.fused import reference, rms_norm

NAMESPACE = "moe_serve"
CPU_INTERPRETER = False     # test-only: our kernels on CPU tensors under TRITON_INTERPRET=1

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define("fused_norm_linear(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight, "
            "Tensor? bias, bool write_h) -> (Tensor, Tensor, Tensor)")
_QK_ARGS = ("Tensor qkv, Tensor positions, Tensor q_norm_weight, Tensor k_norm_weight, float eps, "
            "Tensor cos_sin_cache, int num_q_heads, int num_kv_heads, int head_dim, int rot_dim, bool neox")
_lib.define(f"fused_qk_norm_rope({_QK_ARGS}) -> Tensor")
_lib.define(f"fused_qk_norm_rope_cache({_QK_ARGS}, Tensor(a!) key_cache, Tensor(b!) value_cache, "
            "Tensor slot_mapping) -> Tensor")


NormKey = tuple[int, int, torch.dtype, bool, bool, bool, str]   # N, K, dtype, bias, residual, write_h, device
QkKey = tuple[int, torch.dtype, torch.dtype, int, int, int, int, bool, str]   # row, dtype, positions' dtype, Hq, Hkv, D, rot, neox, device
_seen_norm: dict[NormKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
_seen_qk: dict[QkKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}


def runs_here(x: torch.Tensor) -> bool:
    """Whether our kernels may run on x's device: CUDA, or the CPU under the interpreter when a
    test asked for it."""
    if x.is_cuda:
        return True
    return CPU_INTERPRETER and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


# -- fused_norm_linear --------------------------------------------------------------------
def fused_config(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> Config | None:
    """The config the fused norm GEMV serves this call with, or None where it does not: M past its
    range, a layout it refuses, or a token block its tuned table does not list for this shape."""
    M, (N, K) = x.shape[0], weight.shape
    if M > ng.SERVED_MAX_M or ng.unsupported(x, residual, norm_weight, weight, bias) is not None:
        return None
    return ng.tuned_config(M, N, K, x.dtype, x.device)


def _norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, bias: torch.Tensor | None, write_h: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, res_out, h = None, None, None
    if runs_here(x):
        key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None, residual is not None, write_h,
               str(weight.device))
        _seen_norm.setdefault(key, (weight, norm_weight, bias))
        cfg = fused_config(x, residual, norm_weight, weight, bias)
        if cfg is not None:
            y, res_out, h = ng.norm_gemv(x, residual, norm_weight, eps, weight, bias, write_h, cfg=cfg,
                                         exact_h=ng.SERVED_EXACT_H)
        elif rms_norm.unsupported(x, residual, norm_weight) is None:
            h, res_out = rms_norm.add_rms_norm(x, residual, norm_weight, eps)
            y = dense_linear(h, weight, bias) if current().dense_gemv else F.linear(h, weight, bias)
    if y is None:
        y, res_out, h = reference.norm_linear(x, residual, norm_weight, eps, weight, bias)
    # outputs never alias an input or each other (a custom op's rule): absent ones are fresh empties
    return (y, res_out if residual is not None else x.new_empty(0),
            h if write_h else x.new_empty(0))


def _norm_linear_fake(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, write_h: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return y, torch.empty_like(x) if residual is not None else x.new_empty(0), \
        torch.empty_like(x) if write_h else x.new_empty(0)


def fused_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, write_h: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y [M, N], residual_out [M, K], h [M, K] or None unless write_h) of
    torch.ops.moe_serve.fused_norm_linear for x [M, K], residual [M, K] or None, the norm's
    weight [K] and eps, the linear layer's weight [N, K] and bias [N]; residual_out is x itself
    without a residual (vLLM's layer: the first layer's residual is its input)."""
    y, res_out, h = torch.ops.moe_serve.fused_norm_linear(x, residual, norm_weight, eps, weight, bias, write_h)
    return y, res_out if residual is not None else x, h if write_h else None


# -- fused_qk_norm_rope (+ cache) -----------------------------------------------------------
def _qk(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
        eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, rot_dim: int,
        neox: bool, kv_cache: qk.KVCache | None) -> torch.Tensor:
    args = (qkv, positions, q_norm_weight, k_norm_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
            rot_dim)
    if runs_here(qkv) and kv_cache is None:
        key = (qkv.shape[1], qkv.dtype, positions.dtype, num_q_heads, num_kv_heads, head_dim, rot_dim, neox,
               str(qkv.device))
        _seen_qk.setdefault(key, (q_norm_weight, k_norm_weight, cos_sin_cache, eps))
    if runs_here(qkv) and qk.unsupported(*args, kv_cache) is None:
        out = qkv.new_empty((qkv.shape[0], (num_q_heads + num_kv_heads) * head_dim))
        return qk.qk_norm_rope(qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, num_q_heads,
                               num_kv_heads, head_dim, rot_dim, neox, kv_cache, out=out)
    q, k = reference.qk_norm_rope(qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, num_q_heads,
                                  num_kv_heads, head_dim, rot_dim, neox)
    if kv_cache is not None:
        T, kv = qkv.shape[0], num_kv_heads * head_dim
        v = qkv[:, qkv.shape[1] - kv:]
        reference.write_kv_cache(k.reshape(T, num_kv_heads, head_dim), v.reshape(T, num_kv_heads, head_dim),
                                 *kv_cache)
    return torch.cat((q, k), dim=-1)


def _qk_op(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
           eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
           rot_dim: int, neox: bool) -> torch.Tensor:
    return _qk(qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, num_q_heads, num_kv_heads,
               head_dim, rot_dim, neox, None)


def _qk_cache_op(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
                 k_norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, rot_dim: int, neox: bool, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    return _qk(qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, num_q_heads, num_kv_heads,
               head_dim, rot_dim, neox, (key_cache, value_cache, slot_mapping))


def _qk_fake(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
             eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
             rot_dim: int, neox: bool) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], (num_q_heads + num_kv_heads) * head_dim))


def _qk_cache_fake(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
                   k_norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, rot_dim: int, neox: bool, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    return _qk_fake(qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, num_q_heads, num_kv_heads,
                    head_dim, rot_dim, neox)


def fused_qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, num_q_heads: int,
                       num_kv_heads: int, head_dim: int, rot_dim: int, neox: bool,
                       kv_cache: qk.KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, Hq * D], k [T, Hkv * D]): qkv's heads normalised and rotated (views of the op's one
    output); with kv_cache (key_cache, value_cache, slot_mapping), K and V written there too."""
    if kv_cache is None:
        out = torch.ops.moe_serve.fused_qk_norm_rope(qkv, positions, q_norm_weight, k_norm_weight, eps,
                                                     cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rot_dim,
                                                     neox)
    else:
        out = torch.ops.moe_serve.fused_qk_norm_rope_cache(qkv, positions, q_norm_weight, k_norm_weight, eps,
                                                           cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                                                           rot_dim, neox, *kv_cache)
    return out.split([num_q_heads * head_dim, num_kv_heads * head_dim], dim=-1)


_lib.impl("fused_norm_linear", _norm_linear, "CompositeExplicitAutograd")
_lib.impl("fused_qk_norm_rope", _qk_op, "CompositeExplicitAutograd")
_lib.impl("fused_qk_norm_rope_cache", _qk_cache_op, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::fused_norm_linear", _norm_linear_fake, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::fused_qk_norm_rope", _qk_fake, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::fused_qk_norm_rope_cache", _qk_cache_fake, lib=_lib)


def seen_norm_linear() -> dict[NormKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(weight, norm weight, bias) of every fused_norm_linear call kind our kernels ran or could
    run, by its key, in the order first seen (for the warm-up, moe_serve.kernels.fused.warmup)."""
    return dict(_seen_norm)


def seen_qk_norm_rope() -> dict[QkKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """(q norm weight, k norm weight, cos_sin_cache, eps) of every fused_qk_norm_rope call kind
    (without a cache) our kernel ran or could run, by its key."""
    return dict(_seen_qk)
