"""FP8 W8A8 scales of one fused-MoE call: their layouts, the kernels' modes for them (A_MODE,
W_SCALE, C_QUANT of moe_serve.kernels.moe.moe_gemm) and the quantize-once launch.

Three formats (moe_serve.kernels.moe.quant_format names them for the config tables and routing):
    per-tensor / per-channel weights, static per-tensor activation scale (or none: dynamic);
    per_token_act: the same weights with dynamic per-token activations (FP8-dynamic);
    block_shape (bn, bk): weights scaled per [bn, bk] block, activations per token per bk
        columns, both applied per K step (BLOCK_K == bk).
Hidden states arrive as floats (we quantize them: in the K loop, or once with A_PREQUANT) or
already fp8 with their scales (what vLLM's prepare step hands the experts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from moe_serve.kernels.moe import quant_format
from moe_serve.kernels.moe.launch import launch
from moe_serve.kernels.moe.moe_gemm import quant_fp8_kernel

FP8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # see moe_tiles._quant_fp8


@dataclass(frozen=True)
class Fp8Scales:
    """FP8 W8A8 scales (float32).

    w1_scale: [E] per-tensor, [E, 2N] per-channel, or [E, cdiv(2N, bn), cdiv(K, bk)] block;
    w2_scale: [E], [E, K], or [E, cdiv(K, bn), cdiv(N, bk)].
    a1_scale: a static per-tensor scalar; with fp8 hidden states and per_token_act the tokens'
        scales [M] / [M, 1], with block_shape their group scales [M, cdiv(K, bk)]; None: dynamic
        (computed by our kernels: per token, or per token group for block_shape).
    a2_scale: a static per-tensor scalar, or None: dynamic (per token; per group for block).
    """

    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    a1_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    block_shape: tuple[int, int] | None = None
    per_token_act: bool = False

    @property
    def format(self) -> str:
        """The quant_format key of these scales."""
        if self.block_shape:
            return quant_format.block_key(*self.block_shape)
        return quant_format.PER_TOKEN if self.per_token_act else quant_format.FP8

    @property
    def group_k(self) -> int:
        """Activation group (columns) of block scales; 0 otherwise."""
        return self.block_shape[1] if self.block_shape else 0

    @property
    def group_n(self) -> int:
        return self.block_shape[0] if self.block_shape else 0


def check(fp8: Fp8Scales, x: torch.Tensor, E: int, N: int, K: int) -> None:
    """Raise ValueError when the scales do not fit the call's shapes and format."""
    M = x.shape[0]
    if fp8.block_shape:
        bn, bk = fp8.block_shape
        if bn < 1 or bk < 16 or bk & (bk - 1):
            raise ValueError(f"block_shape {fp8.block_shape}: the activation group bk must be a "
                             f"power of two >= 16 (it is the K loop's BLOCK_K)")
        if fp8.a2_scale is not None or fp8.per_token_act:
            raise ValueError("block FP8 activations are dynamic per token group (a2_scale None)")
        for what, s, rows, cols in (("w1_scale", fp8.w1_scale, 2 * N, K),
                                    ("w2_scale", fp8.w2_scale, K, N)):
            want = (E, -(-rows // bn), -(-cols // bk))
            if tuple(s.shape) != want:
                raise ValueError(f"{what} {tuple(s.shape)}: block {fp8.block_shape} needs {want}")
        want_a = (M, -(-K // bk))
    else:
        weight_scale(fp8.w1_scale, E, 2 * N, "w1_scale")
        weight_scale(fp8.w2_scale, E, K, "w2_scale")
        if fp8.per_token_act and fp8.a2_scale is not None:
            raise ValueError("per-token activations are dynamic (a2_scale None)")
        want_a = (M,) if fp8.per_token_act else ()
    a1 = fp8.a1_scale
    if x.dtype == FP8:
        if a1 is None or a1.numel() != max(1, _numel(want_a)):
            raise ValueError(f"fp8 hidden states need their a1_scale {want_a or 'scalar'}, got "
                             f"{None if a1 is None else tuple(a1.shape)}")
    elif a1 is not None and (fp8.block_shape or fp8.per_token_act):
        raise ValueError("float hidden states of a dynamic format take no a1_scale")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_scale(scale: torch.Tensor, E: int, rows: int, what: str) -> tuple[torch.Tensor, int]:
    """A per-tensor or per-channel weight scale as [E, 1] (W_SCALE 1) or [E, rows] (2)."""
    if scale.numel() == E:
        return scale.reshape(E, 1), 1
    if scale.numel() == E * rows:
        return scale.reshape(E, rows), 2
    raise ValueError(f"{what} must have E={E} (per-tensor) or E*{rows} (per-channel) elements, "
                     f"got shape {tuple(scale.shape)}")


def weight_scales(fp8: Fp8Scales | None, E: int, N: int, K: int) -> tuple:
    """(w1 scale, its W_SCALE, w2 scale, its W_SCALE); None, 0 for 16/32-bit weights."""
    if fp8 is None:
        return None, 0, None, 0
    if fp8.block_shape:
        return fp8.w1_scale, 3, fp8.w2_scale, 3
    w1s, m1 = weight_scale(fp8.w1_scale, E, 2 * N, "w1_scale")
    w2s, m2 = weight_scale(fp8.w2_scale, E, K, "w2_scale")
    return w1s, m1, w2s, m2


def gemm1_input(x: torch.Tensor, fp8: Fp8Scales | None,
                prequant: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(A, its scale, A_MODE) of GEMM1: fp8 hidden states as they come (1 static, 4 per token,
    5 per group); float ones quantized once here when prequant (a quant_fp8_kernel launch),
    else in the K loop (2 static, 3 per token, 6 per group)."""
    if fp8 is None:
        return x, None, 0
    a1 = fp8.a1_scale
    M = x.shape[0]
    if x.dtype == FP8:
        if fp8.block_shape:
            return x, a1.reshape(M, -1), 5
        return (x, a1.reshape(M), 4) if fp8.per_token_act else (x, a1, 1)
    if fp8.block_shape:
        return (*quantize(x, 2, group=fp8.group_k), 5) if prequant else (x, None, 6)
    if a1 is None:
        return (*quantize(x, 1), 4) if prequant else (x, None, 3)
    return (quantize(x, 0, a1)[0], a1, 1) if prequant else (x, a1, 2)


def quantize(x: torch.Tensor, mode: int, scale: torch.Tensor | None = None,
             group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (fp8 [M, K], scales) in one launch: mode 0 static (scale given),
    1 dynamic per row ([M]), 2 dynamic per row and `group` columns ([M, cdiv(K, group)])."""
    M, K = x.shape
    y = torch.empty((M, K), dtype=FP8, device=x.device)
    if mode == 0:
        s, bk = scale, min(1024, triton.next_power_of_2(K))
        grid, s0, s1 = (M, triton.cdiv(K, bk)), 0, 0
    elif mode == 1:
        s, bk = torch.empty(M, dtype=torch.float32, device=x.device), min(1024, triton.next_power_of_2(K))
        grid, s0, s1 = (M, 1), 1, 0
    else:
        s, bk = torch.empty((M, triton.cdiv(K, group)), dtype=torch.float32, device=x.device), group
        grid, s0, s1 = (M, triton.cdiv(K, group)), s.stride(0), s.stride(1)
    launch(quant_fp8_kernel, grid, x, y, s, K, x.stride(0), y.stride(0), s0, s1,
           SCALE=mode, FP8_PREROUND=INTERPRET, BLOCK_K=bk, num_warps=4)
    return y, s


def scale_strides(s: torch.Tensor | None) -> tuple[int, int]:
    """(row, column) strides of an activation scale tensor ([M] or [M, G]); 0 for scalars."""
    if s is None or s.dim() == 0:
        return 0, 0
    return s.stride(0), (s.stride(1) if s.dim() == 2 else 0)


def block_stride(s: torch.Tensor | None, w_mode: int) -> tuple[int, int, int]:
    """(expert, row, K-group) strides of a weight scale for its W_SCALE."""
    if not w_mode:
        return 0, 0, 0
    return s.stride(0), (s.stride(1) if w_mode >= 2 else 0), (s.stride(2) if w_mode == 3 else 0)


def unit_scales(fmt: str, E: int, N: int, K: int, M: int, x_fp8: bool,
                device: str | torch.device = "cpu") -> Fp8Scales | None:
    """Scales of format `fmt` that are all 1.0, laid out as serving's are: the stand-ins that
    compile (warm-up, precompile) every kernel variant serving launches for the format. x_fp8:
    hidden states arrive fp8 (vLLM quantized them); per-tensor scales are static."""
    if not quant_format.is_fp8(fmt):
        return None
    one = lambda *s: torch.ones(s, device=device)  # noqa: E731
    bs = quant_format.block_shape(fmt)
    if bs:
        bn, bk = bs
        return Fp8Scales(one(E, -(-2 * N // bn), -(-K // bk)), one(E, -(-K // bn), -(-N // bk)),
                         one(M, -(-K // bk)) if x_fp8 else None, None, block_shape=bs)
    if fmt == quant_format.PER_TOKEN:
        return Fp8Scales(one(E, 2 * N), one(E, K), one(M, 1) if x_fp8 else None, None,
                         per_token_act=True)
    return Fp8Scales(one(E), one(E), one(), one())


def gemm2_plan(fp8: Fp8Scales | None, epilogue_bn: int | None) -> tuple[int, int]:
    """(C_QUANT of GEMM1's SiLU epilogue, A_MODE of GEMM2) for the SiLU output `act`.
    Quantized once, in GEMM1's epilogue, where a GEMM1 tile has what the scale needs: the static
    a2 scale -> (1, 1); block with whole activation groups per tile (epilogue_bn % bk == 0)
    -> (2, 5). Else act stays in the output dtype and GEMM2 quantizes it on load: block -> 6,
    dynamic per token -> 3 (needs the whole row), static -> 2 when GEMM1 has no SiLU epilogue
    (epilogue_bn None: split / un-fused GEMM1, GEMM2 applies SiLU on load)."""
    if fp8 is None:
        return 0, 0
    if epilogue_bn is None:
        return 0, 2 if fp8.a2_scale is not None else 6 if fp8.block_shape else 3
    if fp8.a2_scale is not None:
        return 1, 1
    if fp8.block_shape:
        return (2, 5) if epilogue_bn % fp8.group_k == 0 else (0, 6)
    return 0, 3


def quantize_weights(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [E, R, C] -> (fp8, scale) in format `fmt`: absmax / 448 per expert
    ('fp8': [E]), per row (per_token: [E, R]) or per [bn, bk] block ([E, cdiv(R, bn),
    cdiv(C, bk)]). Benchmark and tuning inputs (real checkpoints ship their scales)."""
    E, R, C = w.shape
    bs = quant_format.block_shape(fmt)
    if bs:
        bn, bk = bs
        pad = torch.nn.functional.pad(w, (0, -C % bk, 0, -R % bn))
        blocks = pad.reshape(E, pad.shape[1] // bn, bn, pad.shape[2] // bk, bk)
        scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12).float()
        full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :R, :C]
        return (w / full).clamp(-448, 448).to(FP8), scale
    per_row = fmt == quant_format.PER_TOKEN
    amax = w.abs().amax(dim=2) if per_row else w.abs().flatten(1).amax(dim=1)
    scale = (amax / 448.0).clamp(min=1e-12).float()
    return (w / scale.reshape(E, -1, 1)).clamp(-448, 448).to(FP8), scale
