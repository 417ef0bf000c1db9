"""The fused pieces of a decode step and the unfused chains they replace, as timeable cases.

Each case holds n_sets independent input sets (weights included, together beyond twice the L2, so
no replay finds the last one's weights in L2: in a step the next layer has other weights) and three
callables of a set index: `fused` (our piece), `chain` (what vLLM serves today: its native torch
composition compiled by Inductor, as vLLM compiles a model at its default -O level, then cuBLAS) and,
where one exists, `alt` (vLLM's own fused op for the same work: the CUDA kernel of its Q/K norm + RoPE
pass). `check` runs each once on a fresh set and returns their relative errors against float64.

| piece | switch | per step | fused | chain |
|---|---|---|---|---|
| norm_gemv/qkv | fuse_norm_gemv | layers | residual add + RMSNorm + QKV GEMV, one launch | add + RMSNorm, F.linear |
| norm_gemv/gate | fuse_norm_gemv | layers | post-attention add + RMSNorm + router gate GEMV, h written | add + RMSNorm, F.linear |
| norm_gemv/lm_head | fuse_norm_gemv | 1 | final add + RMSNorm + lm_head GEMV | add + RMSNorm, F.linear |
| qk_norm_rope | fuse_qk_norm_rope | layers | Q/K RMSNorm + RoPE, one launch | per-head norms + RoPE; alt: vLLM's fused_qk_norm_rope |
| qk_norm_rope_cache | fuse_qk_norm_rope | layers | and the K / V paged-cache write | the same + reshape_and_cache_flash |

On a CPU (the dry run) the fused side runs the ops' torch fallbacks: it proves the harness, not a time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from bench.step.shapes import StepShapes
from kernels.fused import reference

L2_BYTES = 60 * 2 ** 20          # the H200's L2 (the H100's is 50 MiB): sets rotate past twice this
MAX_SETS = 32
Run = Callable[[int], Any]


@dataclass
class Case:
    """One piece at one shape and token count M, ready to time (bench.step.kernel_level)."""

    piece: str
    switch: str
    shape: str                      # e.g. "5120x2048"
    M: int
    per_step: int                   # how many times a decode step runs it (layers, or 1)
    n_sets: int
    floor_bytes: int                # what it must read and write once (weights, activations, cache rows)
    fused: Run
    chain: Run
    check: Callable[[], dict[str, float]]
    alt: Run | None = None
    notes: list[str] = field(default_factory=list)


def n_sets(bytes_per_set: int) -> int:
    return max(2, min(MAX_SETS, -(-2 * L2_BYTES // max(bytes_per_set, 1)) + 1))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf where out has a NaN (an element left unwritten)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def _compiled(fn: Callable) -> Callable:
    """fn compiled as vLLM compiles its model's native ops (Inductor) on CUDA; itself on a CPU."""
    return torch.compile(fn, dynamic=False, fullgraph=True) if torch.cuda.is_available() else fn


_add_rms_norm = _compiled(reference.add_rms_norm)
_qk_norm_rope = _compiled(reference.qk_norm_rope)


def _randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def norm_gemv_case(name: str, s: StepShapes, N: int, M: int, per_step: int, write_h: bool,
                   dtype: torch.dtype, device: str) -> Case:
    """residual add + RMSNorm + the next layer's GEMV (weight [N, hidden])."""
    from kernels.fused.ops import fused_norm_linear

    K = s.hidden
    w_bytes = N * K * dtype.itemsize
    sets = [dict(x=_randn(M, K, dtype=dtype, device=device), res=_randn(M, K, dtype=dtype, device=device),
                 nw=_randn(K, dtype=dtype, device=device, scale=0.1).add_(1),
                 w=_randn(N, K, dtype=dtype, device=device, scale=K ** -0.5))
            for _ in range(n_sets(w_bytes))]

    def fused(i: int) -> Any:
        t = sets[i]
        return fused_norm_linear(t["x"], t["res"], t["nw"], s.eps, t["w"], None, write_h)

    def chain(i: int) -> Any:
        t = sets[i]
        h, res_out = _add_rms_norm(t["x"], t["res"], t["nw"], s.eps)
        return F.linear(h, t["w"]), res_out, h

    def check() -> dict[str, float]:
        t = {k: v.clone() for k, v in sets[0].items()}
        t["x"].copy_(_randn(M, K, dtype=dtype, device=device))
        y64, r64, h64 = reference.norm_linear(*(t[k].double() for k in ("x", "res", "nw")), s.eps,
                                              t["w"].double(), None)
        y, r, h = fused_norm_linear(t["x"], t["res"], t["nw"], s.eps, t["w"], None, write_h)
        yc = F.linear(_add_rms_norm(t["x"], t["res"], t["nw"], s.eps)[0], t["w"])
        out = {"fused": rel_err(y, y64), "chain": rel_err(yc, y64), "residual": rel_err(r, r64)}
        if write_h:
            out["h"] = rel_err(h, h64)
        return out

    act = 2 * M * K * dtype.itemsize
    return Case(name, "fuse_norm_gemv", f"{N}x{K}", M, per_step, len(sets),
                w_bytes + K * dtype.itemsize + 2 * act + M * N * dtype.itemsize + (act if write_h else 0),
                fused, chain, check)


def _rope_cache(s: StepShapes, max_pos: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """cos | sin [max_pos, rot_dim] as vLLM's RotaryEmbedding builds it (base rope_theta)."""
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.rot_dim, 2, dtype=torch.float32) / s.rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(device)


def qk_norm_rope_case(s: StepShapes, M: int, with_cache: bool, dtype: torch.dtype, device: str) -> Case:
    """Qwen3's per-head Q/K RMSNorm + RoPE on the QKV GEMV's output (+ the paged KV-cache write)."""
    from kernels.fused.ops import fused_qk_norm_rope

    Hq, Hkv, D = s.q_heads, s.kv_heads, s.head_dim
    block, blocks = 16, 64
    cache_shape = (blocks, block, Hkv, D)
    cos_sin = _rope_cache(s, 4096, torch.float32 if dtype == torch.float32 else dtype, device)
    row = (Hq + 2 * Hkv) * D
    sets = [dict(qkv=_randn(M, row, dtype=dtype, device=device),
                 pos=torch.randint(0, 4096, (M,), device=device),
                 qw=_randn(D, dtype=dtype, device=device, scale=0.1).add_(1),
                 kw=_randn(D, dtype=dtype, device=device, scale=0.1).add_(1),
                 kc=torch.zeros(cache_shape, dtype=dtype, device=device),
                 vc=torch.zeros(cache_shape, dtype=dtype, device=device),
                 slots=torch.randperm(blocks * block, device=device)[:M])
            for _ in range(n_sets(M * row * dtype.itemsize * 2))]
    qk_cols = (Hq + Hkv) * D
    fused_args = (s.eps, cos_sin, Hq, Hkv, D, s.rot_dim, True)

    def fused(i: int) -> Any:
        t = sets[i]
        cache = (t["kc"], t["vc"], t["slots"]) if with_cache else None
        return fused_qk_norm_rope(t["qkv"], t["pos"], t["qw"], t["kw"], *fused_args, cache)

    def chain(i: int) -> Any:
        t = sets[i]
        q, k = _qk_norm_rope(t["qkv"], t["pos"], t["qw"], t["kw"], *fused_args)
        if with_cache:
            _write_cache(k.view(M, Hkv, D), t["qkv"][:, qk_cols:].view(M, Hkv, D), t["kc"], t["vc"], t["slots"])
        return q, k

    def alt(i: int) -> Any:       # vLLM's fused_qk_norm_rope CUDA op, in place on the set's qkv
        t = sets[i]
        torch.ops._C.fused_qk_norm_rope(t["qkv"], Hq, Hkv, Hkv, D, s.eps, t["qw"], t["kw"],
                                        cos_sin, True, t["pos"])
        if with_cache:
            _write_cache(t["qkv"][:, Hq * D:qk_cols].view(M, Hkv, D), t["qkv"][:, qk_cols:].view(M, Hkv, D),
                         t["kc"], t["vc"], t["slots"])
        return t["qkv"]

    def check() -> dict[str, float]:
        t = {k: v.clone() for k, v in sets[0].items()}
        t["qkv"].copy_(_randn(M, row, dtype=dtype, device=device))
        q64, k64 = reference.qk_norm_rope(t["qkv"].double(), t["pos"], t["qw"].double(), t["kw"].double(),
                                          s.eps, cos_sin.double(), Hq, Hkv, D, s.rot_dim, True)
        ref = torch.cat((q64, k64), dim=-1)
        cache = (t["kc"], t["vc"], t["slots"]) if with_cache else None
        got = torch.cat(fused_qk_norm_rope(t["qkv"].clone(), t["pos"], t["qw"], t["kw"], *fused_args, cache), dim=-1)
        q, k = _qk_norm_rope(t["qkv"], t["pos"], t["qw"], t["kw"], *fused_args)
        out = {"fused": rel_err(got, ref), "chain": rel_err(torch.cat((q, k), dim=-1), ref)}
        if with_cache:
            rows = t["slots"].long()
            kc = t["kc"].view(-1, Hkv, D)[rows].reshape(M, -1)
            out["cache"] = rel_err(kc, k64)
        return out

    cache_bytes = 2 * M * Hkv * D * dtype.itemsize if with_cache else 0
    name = "qk_norm_rope_cache" if with_cache else "qk_norm_rope"
    case = Case(name, "fuse_qk_norm_rope", f"{Hq}+{Hkv}x{D}", M, s.layers, len(sets),
                M * row * dtype.itemsize + M * qk_cols * dtype.itemsize + cache_bytes, fused, chain, check)
    if torch.cuda.is_available() and hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "fused_qk_norm_rope"):
        case.alt = alt
    return case


def _write_cache(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM's paged-cache write (reshape_and_cache_flash on CUDA, its torch composition elsewhere)."""
    if k.is_cuda and hasattr(torch.ops, "_C_cache_ops"):
        one = torch.ones((), dtype=torch.float32, device=k.device)
        torch.ops._C_cache_ops.reshape_and_cache_flash(k, v, kc, vc, slots, "auto", one, one)
    else:
        reference.write_kv_cache(k, v, kc, vc, slots)


def cases(s: StepShapes, Ms: tuple[int, ...], pieces: tuple[str, ...], dtype: torch.dtype,
          device: str) -> list[Case]:
    """Every (piece, M) asked for, in the order asked."""
    build: dict[str, Callable[[int], Case]] = {
        "norm_gemv/qkv": lambda M: norm_gemv_case("norm_gemv/qkv", s, s.qkv_rows, M, s.layers, False, dtype, device),
        "norm_gemv/gate": lambda M: norm_gemv_case("norm_gemv/gate", s, s.experts, M, s.layers, True, dtype, device),
        "norm_gemv/lm_head": lambda M: norm_gemv_case("norm_gemv/lm_head", s, s.vocab, M, 1, False, dtype, device),
        "qk_norm_rope": lambda M: qk_norm_rope_case(s, M, False, dtype, device),
        "qk_norm_rope_cache": lambda M: qk_norm_rope_case(s, M, True, dtype, device),
    }
    unknown = [p for p in pieces if p not in build]
    if unknown:
        raise ValueError(f"unknown pieces {unknown}; known: {', '.join(build)}")
    skip = {"qk_norm_rope", "qk_norm_rope_cache"} if not s.qk_norm else set()
    skip |= {"norm_gemv/gate"} if not s.experts else set()
    return [build[p](M) for p in pieces if p not in skip for M in Ms]


PIECES = ("norm_gemv/qkv", "norm_gemv/gate", "norm_gemv/lm_head", "qk_norm_rope", "qk_norm_rope_cache")
