"""Float64 torch reference of the whole MoE layer and random-input helpers for the tests."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def moe_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_w: torch.Tensor,
                  topk_ids: torch.Tensor, w1_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, a1_scale: torch.Tensor | None = None,
                  on_input: bool = False, quant_acts: str | None = None,
                  a2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[m] = sum_j w_mj * W2[e] (silu(W1g[e] x) * W1u[e] x) in float64. FP8 weights are
    dequantized with their (per-tensor [E] or per-channel) scales; fp8 x uses a1_scale.
    quant_acts='static'|'dynamic' also rounds x and the SiLU output through fp8 the way the
    kernel does (static: a1/a2 scale; dynamic: per-token absmax / 448)."""
    E = w1.shape[0]
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized float64 weights of one expert (on x's device), converted once."""
        if e not in cache or x.is_cuda:  # on the GPU: no cache (DeepSeek experts are big)
            a, b = w1[e].double(), w2[e].double()
            if w1_scale is not None:
                a = a * w1_scale.double().reshape(E, -1, 1)[e]
                b = b * w2_scale.double().reshape(E, -1, 1)[e]
            cache[e] = (a, b)
        return cache[e]

    X = x.double()
    if x.dtype == FP8:
        X = X * a1_scale.double()
    N = w1.shape[1] // 2
    tw = topk_w.double()
    ids = topk_ids.long().tolist()
    out = torch.zeros(X.shape, dtype=torch.float64, device=X.device)
    for m in range(X.shape[0]):
        for j in range(len(ids[m])):
            W1, W2 = expert(ids[m][j])
            xq = _fake_quant(X[m], quant_acts, a1_scale)
            h = W1 @ (xq * tw[m, j] if on_input else xq)           # [2N]
            a = _fake_quant(torch.nn.functional.silu(h[:N]) * h[N:], quant_acts, a2_scale)
            y = W2 @ a                                             # [K]
            out[m] += y if on_input else tw[m, j] * y
    return out


def _fake_quant(v: torch.Tensor, mode: str | None, scale: torch.Tensor | None) -> torch.Tensor:
    """Round a float64 vector through float8_e4m3fn with a static or per-token scale."""
    if mode is None:
        return v
    s = scale.double().to(v.device) if mode == "static" else v.abs().max().clamp(min=1e-10) / 448.0
    return (v / s).clamp(-448, 448).to(FP8).double() * s


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
