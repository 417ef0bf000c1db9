"""Float64 torch reference of the whole MoE layer and random-input helpers for the tests."""
from __future__ import annotations

import os
from typing import Callable

import torch

FP8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def moe_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_w: torch.Tensor,
                  topk_ids: torch.Tensor, w1_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, a1_scale: torch.Tensor | None = None,
                  on_input: bool = False, quant_acts: str | None = None,
                  a2_scale: torch.Tensor | None = None,
                  block_shape: tuple[int, int] | None = None,
                  act_round: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """out[m] = sum_j w_mj * W2[e] (silu(W1g[e] x) * W1u[e] x) in float64. FP8 weights are
    dequantized with their (per-tensor [E], per-channel, or with block_shape (bn, bk) per-block
    [E, cdiv(R, bn), cdiv(C, bk)]) scales; fp8 x uses a1_scale (scalar, per token [M(, 1)], or
    per token group [M, cdiv(K, bk)]). quant_acts='static'|'dynamic'|'group' also rounds x and
    the SiLU output through fp8 the way the kernel does (static: a1/a2 scale; dynamic:
    per-token absmax / 448; group: per token and bk columns); act_round rounds the SiLU output
    first, as where the kernel stores it in the output dtype and GEMM2 quantizes it on load
    (as_kernel_bf16). Experts < 0 contribute nothing."""
    E = w1.shape[0]
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized float64 weights of one expert (on x's device), converted once."""
        if e not in cache or x.is_cuda:  # on the GPU: no cache (DeepSeek experts are big)
            a, b = w1[e].double(), w2[e].double()
            if w1_scale is not None:
                a = a * _weight_scale(w1_scale, E, a.shape, block_shape)[e]
                b = b * _weight_scale(w2_scale, E, b.shape, block_shape)[e]
            cache[e] = (a, b)
        return cache[e]

    M, K = x.shape
    X = x.double()
    if x.dtype == FP8:
        X = X * _act_scale(a1_scale, M, K, block_shape).to(X.device)
    N = w1.shape[1] // 2
    tw = topk_w.double()
    ids = topk_ids.long().tolist()
    group = block_shape[1] if block_shape else 0
    out = torch.zeros(X.shape, dtype=torch.float64, device=X.device)
    for m in range(M):
        for j in range(len(ids[m])):
            if ids[m][j] < 0:
                continue
            W1, W2 = expert(ids[m][j])
            xq = _fake_quant(X[m], quant_acts, a1_scale, group)
            h = W1 @ (xq * tw[m, j] if on_input else xq)           # [2N]
            a = torch.nn.functional.silu(h[:N]) * h[N:]                     # [N]
            if act_round is not None:
                a = act_round(a)
            a = _fake_quant(a, quant_acts, a2_scale, group)
            y = W2 @ a                                             # [K]
            out[m] += y if on_input else tw[m, j] * y
    return out


def as_kernel_bf16(v: torch.Tensor) -> torch.Tensor:
    """v rounded to bf16 the way a kernel's cast does, back in v's dtype: to nearest even on the
    GPU; Triton's interpreter truncates (drops the low 16 bits of the fp32)."""
    if not INTERPRET:
        return v.to(torch.bfloat16).to(v.dtype)
    bits = v.float().view(torch.int32) & -65536                      # 0xFFFF0000
    return bits.view(torch.float32).to(v.dtype)


def _weight_scale(s: torch.Tensor, E: int, shape: torch.Size,
                  block: tuple[int, int] | None) -> torch.Tensor:
    """[E, R, C or 1] float64 multiplier of an expert's [R, C] weights."""
    if block is None:
        return s.double().reshape(E, -1, 1)
    R, C = shape
    return s.double().repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)[:, :R, :C]


def _act_scale(a1: torch.Tensor, M: int, K: int, block: tuple[int, int] | None) -> torch.Tensor:
    """[M, K]-broadcastable float64 multiplier of fp8 hidden states."""
    a = a1.double()
    if a.numel() == 1:
        return a.reshape(())
    a = a.reshape(M, -1)
    return a.repeat_interleave(block[1], 1)[:, :K] if block else a


def _fake_quant(v: torch.Tensor, mode: str | None, scale: torch.Tensor | None,
                group: int = 0) -> torch.Tensor:
    """Round a float64 vector through float8_e4m3fn with a static, per-token or per-group scale."""
    if mode is None:
        return v
    if mode == "group":
        pad = torch.nn.functional.pad(v, (0, -v.numel() % group)).reshape(-1, group)
        s = pad.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / 448.0
        return ((pad / s).clamp(-448, 448).to(FP8).double() * s).reshape(-1)[:v.numel()]
    s = scale.double().to(v.device) if mode == "static" else v.abs().max().clamp(min=1e-10) / 448.0
    return (v / s).clamp(-448, 448).to(FP8).double() * s


def quant_fp8_block(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [E, R, C] weights to fp8 per [bn, bk] block: scale [E, cdiv(R, bn), cdiv(C, bk)]
    = block absmax / 448 (DeepSeek-V3's weight_scale_inv layout)."""
    E, R, C = w.shape
    pad = torch.nn.functional.pad(w, (0, -C % bk, 0, -R % bn))
    blocks = pad.reshape(E, pad.shape[1] // bn, bn, pad.shape[2] // bk, bk)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-8).float()
    full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :R, :C]
    return (w / full).clamp(-448, 448).to(FP8), scale


def quant_act_groups(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states as vLLM's prepare step hands them to the experts for block FP8:
    (fp8 [M, K], scales [M, cdiv(K, bk)]), per token and bk columns (per_token_group_quant_fp8)."""
    M, K = x.shape
    pad = torch.nn.functional.pad(x.float(), (0, -K % bk)).reshape(M, -1, bk)
    s = pad.abs().amax(dim=2).clamp(min=1e-10) / 448.0
    q = (pad / s[:, :, None]).clamp(-448, 448).reshape(M, -1)[:, :K].to(FP8)
    return q, s


def routing(M: int, E: int, topk: int, gen: torch.Generator, device: str = "cpu",
            ids_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-of-random-logits top-k routing: weights [M, topk] f32, ids [M, topk]."""
    logits = torch.randn(M, E, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(topk, dim=-1)
    return w.float().to(device), ids.to(ids_dtype).to(device)


def quant_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [E, R, C] weights to fp8: scale [E] (per-tensor) or [E, R] (per-channel)."""
    amax = w.abs().amax(dim=2) if per_channel else w.abs().flatten(1).amax(dim=1)
    scale = (amax / 448.0).clamp(min=1e-8).float()
    s = scale.reshape(w.shape[0], -1, 1)
    return (w / s).clamp(-448, 448).to(FP8), scale


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (NaN anywhere in out gives NaN)."""
    return float((out.double().to(ref.device) - ref).norm() / ref.norm())


def act_amax(x: torch.Tensor, w1: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """max |silu(gate) * up| over the routed (token, expert) pairs: a sane static a2 scale * 448.
    One expert at a time: memory [tokens of e, 2N] (gathering w1[ids] took M*topk*2N*K float64,
    90 GB at Mixtral M=384)."""
    N = w1.shape[1] // 2
    X = x.double()
    amax = torch.zeros((), dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        h = X[(ids == e).any(dim=1)] @ w1[e].double().T                   # [M_e, 2N]
        amax = torch.maximum(amax, (torch.nn.functional.silu(h[:, :N]) * h[:, N:]).abs().max())
    return amax
