"""Kernel-level benchmark cases of the fused pieces: for a shape and M, inputs built once and a
`Pair` of zero-argument callables over them (the fused launch, the unfused chain it replaces,
further baselines by name), each to be captured in a CUDA graph and replayed by a timing
harness (`moe-serve bench step`). Every callable returns its outputs, so a harness can also
check the pair against each other before timing.

The unfused chains are what a decode step runs without the switch: the torch composition with
vLLM's semantics (moe_serve.kernels.fused.reference) compiled by Inductor, as vLLM's compiled graph
compiles RMSNorm / RotaryEmbedding.forward_native between its custom ops, then
``torch.ops.moe_serve.dense_linear`` for the GEMM (our GEMV where a tuned table lists the shape,
cuBLAS otherwise: what moe-serve serves today). `compile_unfused=False` runs the composition
eagerly (CPU dry runs). Baselines where vLLM is importable: vLLM's own fused Q/K norm + RoPE CUDA
op (``_C.fused_qk_norm_rope``, what its QK-norm-RoPE compile pass inserts) and its
reshape_and_cache_flash for the cache write.

What the GPU decides from these: whether each piece beats its chain at M = 1..16 (the switch's
default); SERVED_EXACT_H (`fused` against `folded`); the norm GEMV's configs (`cfg`, e.g. more
rows per program than the plain GEMV's table, since each program re-derives h).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moe_serve.kernels.dense.op import dense_linear
from moe_serve.kernels.fused import norm_gemv as ng
from moe_serve.kernels.fused import qk_norm_rope as qk
from moe_serve.kernels.fused import reference

Fn = Callable[[], Any]
QWEN3_30B_A3B = {  # the decode step's fused pieces on Qwen3-30B-A3B (TP 1), bf16
    "qkv": {"N": 5120, "K": 2048},                      # input norm + QKV
    "gate": {"N": 128, "K": 2048, "write_h": True},     # post-attention norm + router gate, h kept
    "qk": {"Hq": 32, "Hkv": 4, "D": 128},               # q/k norm + RoPE (+ the KV-cache write)
}


@dataclass(frozen=True)
class Pair:
    """fused / unfused callables (and more baselines) over one case's inputs; bytes: what the
    fused piece must move at least (weights, activations in and out, cache writes)."""

    fused: Fn
    unfused: Fn
    others: dict[str, Fn] = field(default_factory=dict)
    bytes: int = 0


def _maybe_compile(fn: Callable, compile_unfused: bool) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True) if compile_unfused else fn


def _vllm_ops() -> Any:
    """vllm._custom_ops where vLLM's CUDA ops are built, else None."""
    with contextlib.suppress(Exception):
        from vllm import _custom_ops

        if hasattr(torch.ops._C, "fused_qk_norm_rope") and hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
            return _custom_ops
    return None


def norm_gemv(N: int, K: int, M: int, dtype: torch.dtype = torch.bfloat16, residual: bool = True,
              write_h: bool = False, device: str = "cuda", cfg: dict | None = None,
              compile_unfused: bool = True, seed: int = 0) -> Pair:
    """Residual add + RMSNorm + GEMV [N, K] at M tokens: fused = norm_gemv with h as vLLM rounds
    it; others["folded"] = with s * w (rstd on the sums); unfused = the norm (Inductor) then
    dense_linear."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    r = torch.randn(M, K, generator=g, device=device).to(dtype) if residual else None
    nw = (1 + 0.1 * torch.randn(K, generator=g, device=device)).to(dtype)
    w = (torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(dtype)
    norm = _maybe_compile(reference.add_rms_norm, compile_unfused)

    def unfused() -> Any:
        h, res_out = norm(x, r, nw, 1e-6)
        return dense_linear(h, w), res_out, h

    size = torch.empty(0, dtype=dtype).element_size()
    moved = size * (N * K + M * K * (1 + residual + residual + write_h) + M * N + K)
    return Pair(fused=lambda: ng.norm_gemv(x, r, nw, 1e-6, w, write_h=write_h, cfg=cfg, exact_h=True),
                unfused=unfused,
                others={"folded": lambda: ng.norm_gemv(x, r, nw, 1e-6, w, write_h=write_h, cfg=cfg, exact_h=False)},
                bytes=moved)


def qk_norm_rope(Hq: int, Hkv: int, D: int, M: int, rot_dim: int | None = None, neox: bool = True,
                 kv_cache: bool = False, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                 blocks: int = 1024, block_size: int = 16, compile_unfused: bool = True, seed: int = 0) -> Pair:
    """Q/K RMSNorm + RoPE at M tokens on qkv [M, (Hq + 2 Hkv) * D] (+ K and V into a paged
    cache, slots spread over `blocks`): fused = qk_norm_rope into a fresh q | k buffer; unfused =
    the norms and the rotation (Inductor), then the cache write; others["vllm_fused"] = vLLM's
    fused_qk_norm_rope CUDA op (in place; + its reshape_and_cache_flash), where built."""
    rot = rot_dim or D
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(M, (Hq + 2 * Hkv) * D, generator=g, device=device).to(dtype)
    positions = torch.randint(0, 4096, (M,), generator=g, device=device)
    qw = (1 + 0.1 * torch.randn(D, generator=g, device=device)).to(dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=g, device=device)).to(dtype)
    inv = 1.0 / (1e6 ** (torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(4096, device=device, dtype=torch.float32), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)          # [max_pos, rot]
    cache = None
    if kv_cache:
        shape = (blocks, block_size, Hkv, D)
        slots = torch.randperm(blocks * block_size, generator=g, device=device)[:M]
        cache = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), slots)
    args = (positions, qw, kw, 1e-6, cos_sin, Hq, Hkv, D, rot, neox)
    compose = _maybe_compile(reference.qk_norm_rope, compile_unfused)
    vllm = _vllm_ops()
    one = torch.ones((), dtype=torch.float32, device=device)

    def write(k: torch.Tensor, v: torch.Tensor) -> None:
        """vLLM's reshape_and_cache_flash where built, else the reference (eager: data-dependent
        indexing)."""
        if cache is None:
            return
        if vllm is not None:
            vllm.reshape_and_cache_flash(k.view(M, Hkv, D), v.view(M, Hkv, D), *cache, "auto", one, one)
        else:
            reference.write_kv_cache(k.reshape(M, Hkv, D), v.reshape(M, Hkv, D), *cache)

    def unfused() -> Any:
        q, k = compose(qkv, *args)
        write(k, qkv[:, (Hq + Hkv) * D:])
        return q, k

    others: dict[str, Fn] = {}
    if vllm is not None and rot == D:
        work = qkv.clone()

        def vllm_fused() -> Any:
            vllm.fused_qk_norm_rope(work, Hq, Hkv, Hkv, D, 1e-6, qw, kw, cos_sin, neox, positions)
            write(work[:, Hq * D:(Hq + Hkv) * D], work[:, (Hq + Hkv) * D:])
            return work
        others["vllm_fused"] = vllm_fused
    size = torch.empty(0, dtype=dtype).element_size()
    moved = size * M * ((Hq + Hkv) * D * 2 + (2 * Hkv * D if kv_cache else 0)) + size * M * rot
    return Pair(fused=lambda: qk.qk_norm_rope(qkv, *args, kv_cache=cache,
                                               out=torch.empty(M, (Hq + Hkv) * D, dtype=dtype, device=device)),
                unfused=unfused, others=others, bytes=moved)


def qwen3_cases(M: int, device: str = "cuda", compile_unfused: bool = True) -> dict[str, Pair]:
    """Every fused piece of a Qwen3-30B-A3B decode layer at M tokens, by name."""
    s = QWEN3_30B_A3B
    return {"norm_gemv:qkv": norm_gemv(M=M, device=device, compile_unfused=compile_unfused, **s["qkv"]),
            "norm_gemv:gate": norm_gemv(M=M, device=device, compile_unfused=compile_unfused, **s["gate"]),
            "qk_norm_rope": qk_norm_rope(M=M, device=device, compile_unfused=compile_unfused, **s["qk"]),
            "qk_norm_rope:cache": qk_norm_rope(M=M, kv_cache=True, device=device, compile_unfused=compile_unfused,
                                               **s["qk"])}
