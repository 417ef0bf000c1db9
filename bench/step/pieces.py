"""The fused pieces of a decode step and the unfused chains they replace, as timeable cases.

A case is one piece at one shape and token count M, over n_sets independent input sets (weights
included, together past twice the L2, so no replay finds the last set's weights in L2: in a step
the next layer has other weights). Its sides are callables of a set index: `fused` (our piece),
`chain` (what moe-serve serves without the switch) and `alt` (a baseline by name: vLLM's own fused
op where it has one, or our kernel's other operand rounding). The inputs and sides come from the
pieces' own benchmark cases (moe_serve.kernels.fused.bench_cases; moe_serve.bench.experts.dense_fp8.fp8_bench_cases for
the FP8 GEMV); `check` compares the sides' outputs on set 0 (and float64 where the case gives it).

| piece | switch | per step | fused | chain |
|---|---|---|---|---|
| norm_gemv/qkv | fuse_norm_gemv | layers | residual add + RMSNorm + QKV GEMV, one launch | add + RMSNorm (Inductor), the QKV GEMM |
| norm_gemv/gate | fuse_norm_gemv | layers | post-attention add + RMSNorm + router gate GEMV, h written | add + RMSNorm, the gate GEMM |
| norm_gemv/lm_head | fuse_norm_gemv | 1 | final add + RMSNorm + lm_head GEMV | add + RMSNorm, the lm_head GEMM |
| qk_norm_rope | fuse_qk_norm_rope | layers | Q/K RMSNorm + RoPE, one launch | per-head norms + RoPE (Inductor); alt: vLLM's fused_qk_norm_rope |
| qk_norm_rope_cache | fuse_qk_norm_rope | layers | and the K / V paged-cache write | the same + reshape_and_cache_flash |
| fp8_gemv/qkv, fp8_gemv/o | fp8_dense_gemv | layers | the FP8 weights streamed, dequantized in registers | vLLM's FP8 linear layer |
| decode_attention, decode_attention_4k | decode_attention (not a serving switch yet) | layers | paged decode attention, one launch (256 / 4,096 tokens of context) | vLLM's FA3 as served under full CUDA graphs; alt: FA3 one split, vLLM's Triton kernel |

On a CPU (the dry run) every side runs torch: it proves the harness, not a time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.bench.step.shapes import StepShapes

L2_BYTES = 60 * 2 ** 20          # the H200's L2 (the H100's: 50 MiB): sets rotate past twice this
MAX_SETS = 16
Run = Callable[[int], Any]
PIECES = ("norm_gemv/qkv", "norm_gemv/gate", "norm_gemv/lm_head", "qk_norm_rope", "qk_norm_rope_cache",
          "fp8_gemv/qkv", "fp8_gemv/o", "decode_attention", "decode_attention_4k")
CONTEXTS = {"decode_attention": 256, "decode_attention_4k": 4096}   # tokens of context per sequence


@dataclass
class Case:
    """One piece at one shape and M, ready to time (moe_serve.bench.step.kernel_level)."""

    piece: str
    switch: str
    shape: str                      # e.g. "5120x2048"
    M: int
    per_step: int                   # how many times a decode step runs it (layers, or 1)
    n_sets: int
    floor_bytes: int                # what it must move at least (weights, activations, cache rows)
    fused: Run
    chain: Run
    check: Callable[[], dict[str, float]]
    alt: dict[str, Run] = field(default_factory=dict)


def n_sets(bytes_per_set: int, device: str = "cuda") -> int:
    """Input sets to rotate: past twice the L2 on a GPU; two on a CPU (no cache to defeat)."""
    if device != "cuda":
        return 2
    return max(2, min(MAX_SETS, -(-2 * L2_BYTES // max(bytes_per_set, 1)) + 1))


def _rotated(piece: str, switch: str, shape: str, M: int, per_step: int, make: Callable[[int], Any],
             per_set_bytes: int, compare: Callable[[Any, Any], dict[str, float]], device: str) -> Case:
    """A case over n_sets pairs of moe_serve.kernels.fused.bench_cases (one per seed)."""
    pairs = [make(seed) for seed in range(n_sets(per_set_bytes, device))]
    names = sorted(set().union(*(p.others for p in pairs)))

    def check() -> dict[str, float]:
        p = make(len(pairs))                 # a fresh input set
        return compare(p.fused(), p.unfused())

    return Case(piece, switch, shape, M, per_step, len(pairs), pairs[0].bytes,
                fused=lambda i: pairs[i].fused(), chain=lambda i: pairs[i].unfused(), check=check,
                alt={n: (lambda i, n=n: pairs[i].others[n]()) for n in names})


def _gemv_compare(fused: Any, chain: Any) -> dict[str, float]:
    return {"fused": rel_err(fused[0], chain[0])}


def _qk_compare(fused: Any, chain: Any) -> dict[str, float]:
    return {"fused": rel_err(fused, torch.cat(chain, dim=-1))}


def norm_gemv_shape(piece: str, s: StepShapes) -> tuple[int, int, bool]:
    """(N, how many times a decode step runs it, write_h) of a norm_gemv piece at these shapes."""
    return {"norm_gemv/qkv": (s.qkv_rows, s.layers, False), "norm_gemv/gate": (s.experts, s.layers, True),
            "norm_gemv/lm_head": (s.vocab, 1, False)}[piece]


def norm_gemv_case(piece: str, s: StepShapes, M: int, dtype: torch.dtype, device: str) -> Case:
    from moe_serve.kernels.fused import bench_cases

    N, per_step, write_h = norm_gemv_shape(piece, s)

    def make(seed: int) -> Any:
        return bench_cases.norm_gemv(N, s.hidden, M, dtype=dtype, write_h=write_h, device=device,
                                     compile_unfused=device == "cuda", seed=seed)
    return _rotated(piece, "fuse_norm_gemv", f"{N}x{s.hidden}", M, per_step, make,
                    N * s.hidden * dtype.itemsize, _gemv_compare, device)


def qk_norm_rope_case(s: StepShapes, M: int, with_cache: bool, dtype: torch.dtype, device: str) -> Case:
    from moe_serve.kernels.fused import bench_cases

    def make(seed: int) -> Any:
        return bench_cases.qk_norm_rope(s.q_heads, s.kv_heads, s.head_dim, M, rot_dim=s.rot_dim,
                                        kv_cache=with_cache, dtype=dtype, device=device,
                                        compile_unfused=device == "cuda", seed=seed)
    row = (s.q_heads + 2 * s.kv_heads) * s.head_dim * M * dtype.itemsize
    return _rotated("qk_norm_rope_cache" if with_cache else "qk_norm_rope", "fuse_qk_norm_rope",
                    f"{s.q_heads}+{s.kv_heads}x{s.head_dim}", M, s.layers, make, row, _qk_compare, device)


def fp8_gemv_case(piece: str, s: StepShapes, N: int, K: int, M: int, fmt: str) -> Case:
    """Our FP8 GEMV against vLLM's FP8 linear layer on the same stored weights, both checked against
    float64 by fp8_bench_cases before they are returned. The case's errors are each one's against
    float64, not fused against chain: vLLM's W8A8 chain quantizes the activation to FP8 (~3e-2 from
    float64), our GEMV keeps it in bf16."""
    from moe_serve.bench.experts.dense_fp8 import fp8_bench_cases

    ours, vllm, errors = fp8_bench_cases((N, K), M, fmt)
    if vllm is None:
        raise RuntimeError(f"vLLM cannot build its {fmt} linear layer here")
    sets = n_sets(N * K)
    return Case(piece, "fp8_dense_gemv", f"{N}x{K} {fmt}", M, s.layers, sets, N * K + 2 * M * (N + K),
                fused=ours, chain=vllm, check=lambda: {"fused": errors["ours"], "chain": errors["vllm"]})


def decode_attention_case(piece: str, s: StepShapes, M: int, dtype: torch.dtype, device: str) -> Case:
    """Our decode attention against vLLM's FA3 as served (moe_serve.kernels.attention.bench_cases), M
    sequences of CONTEXTS[piece] tokens; checked on a fresh input set, every side against float64
    ("fused" ours, "chain" vLLM's FA3, and each baseline by name)."""
    from moe_serve.kernels.attention import bench_cases as ab

    context = CONTEXTS[piece]

    def inputs(seed: int) -> Any:
        return ab.make_inputs(M, s.q_heads, s.kv_heads, s.head_dim, context, dtype=dtype, device=device, seed=seed)
    per_set = M * context * s.kv_heads * s.head_dim * 2 * dtype.itemsize
    pairs = [ab.decode_attention_pair(inputs(seed)) for seed in range(n_sets(per_set, device))]
    names = sorted(set().union(*(p.others for p in pairs)))

    def check() -> dict[str, float]:
        x = inputs(len(pairs))
        p, ref = ab.decode_attention_pair(x), ab.float64_attention(x)
        return {"fused": rel_err(p.fused(), ref), "chain": rel_err(p.unfused(), ref),
                **{n: rel_err(f(), ref) for n, f in p.others.items()}}
    return Case(piece, "decode_attention", f"{s.q_heads}+{s.kv_heads}x{s.head_dim} L={context}", M, s.layers,
                len(pairs), pairs[0].bytes, fused=lambda i: pairs[i].fused(), chain=lambda i: pairs[i].unfused(),
                check=check, alt={n: (lambda i, n=n: pairs[i].others[n]()) for n in names})


def cases(s: StepShapes, Ms: tuple[int, ...], pieces: tuple[str, ...], dtype: torch.dtype, device: str,
          fp8_format: str | None = None) -> list[Case]:
    """Every (piece, M) asked for that the model has, in the order asked; fp8 pieces only for an
    FP8 checkpoint (fp8_format: moe_serve.bench.experts.dense_fp8's format name)."""
    build: dict[str, Callable[[int], Case]] = {
        **{p: (lambda M, p=p: norm_gemv_case(p, s, M, dtype, device))
           for p in ("norm_gemv/qkv", "norm_gemv/gate", "norm_gemv/lm_head")},
        "qk_norm_rope": lambda M: qk_norm_rope_case(s, M, False, dtype, device),
        "qk_norm_rope_cache": lambda M: qk_norm_rope_case(s, M, True, dtype, device),
        "fp8_gemv/qkv": lambda M: fp8_gemv_case("fp8_gemv/qkv", s, s.qkv_rows, s.hidden, M, fp8_format or ""),
        "fp8_gemv/o": lambda M: fp8_gemv_case("fp8_gemv/o", s, s.hidden, s.o_cols, M, fp8_format or ""),
        **{p: (lambda M, p=p: decode_attention_case(p, s, M, dtype, device)) for p in CONTEXTS},
    }
    unknown = [p for p in pieces if p not in build]
    if unknown:
        raise ValueError(f"unknown pieces {unknown}; known: {', '.join(build)}")
    skip = set() if s.qk_norm else {"qk_norm_rope", "qk_norm_rope_cache"}
    skip |= set() if s.experts else {"norm_gemv/gate"}
    skip |= set() if fp8_format else {"fp8_gemv/qkv", "fp8_gemv/o"}
    return [build[p](M) for p in pieces if p not in skip for M in Ms]
