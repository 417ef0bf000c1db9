"""A dense linear layer at decode: out [M, N] = x [M, K] @ w [N, K]^T for M <= MAX_M tokens.

At one to a few tokens a linear layer is a weight stream, and vLLM's cuBLAS GEMM (a tensor-core
tile of 64 x 8, split-K plus a separate reduce kernel for the narrow layers) reads it well below
the copy ceiling. This runs it as the expert-free case of our decode path's down kernel
(kernels.moe.moe_decode.moe_decode_down_kernel with one expert and top-1: every token's one
"slot" is routed to expert 0, the weight): weight tiles [BLOCK_N, BLOCK_K] fill wgmma's 64-row
slot with the tokens in its N slot (swap-AB), and SPLIT_K programs per output tile reduce
disjoint K ranges into the fp32 split workspace, the tile's last program writing the output:
one launch, no memset, CUDA-graph capturable.

plan(M, N, K) picks the tiles: BLOCK_N x BLOCK_K = 64 x 256 and SPLIT_K a power of two that
gives about TARGET_TILES weight tiles per call (a weight tile is read by all M tokens' programs,
the later ones from L2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.moe.launch import launch
from kernels.moe.moe_decode import moe_decode_down_kernel
from kernels.moe.moe_decode_launch import split_workspace

MAX_M = 4                     # tokens up to which a call is ours (vLLM's ROCm skinny GEMM: the same)
TARGET_TILES = 256            # weight tiles per call: about two per SM on an H200's 132
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ZERO_IDS: dict[str, torch.Tensor] = {}   # per device: [MAX_M] int32 zeros, every slot -> expert 0


@dataclass(frozen=True)
class LinearPlan:
    """Launch parameters of the down kernel for one (M, N, K)."""

    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    SWAP_AB: bool = True
    num_warps: int = 4
    num_stages: int = 4


def plan(M: int, N: int, K: int) -> LinearPlan:
    """Tiles for out [M, N] = x [M, K] @ w [N, K]^T: SPLIT_K the power of two (<= the K chunks)
    nearest below TARGET_TILES / output tiles."""
    block_n, block_k = 64, 256
    chunks = triton.cdiv(K, block_k)
    want = max(1, TARGET_TILES // triton.cdiv(N, block_n))
    split = 1 << (min(want, chunks).bit_length() - 1)
    return LinearPlan(block_n, block_k, split)


def eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether decode_linear takes x [M, K] and w [N, K] (any M): same float dtype, w contiguous."""
    return (x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
            and x.dtype in DTYPES and w.is_contiguous() and x.device == w.device)


def zero_ids(device: torch.device) -> torch.Tensor:
    """[MAX_M] int32 zeros on device, allocated once (before CUDA-graph capture: warm-up calls
    decode_linear eagerly first)."""
    key = str(device)
    if key not in _ZERO_IDS:
        _ZERO_IDS[key] = torch.zeros(MAX_M, dtype=torch.int32, device=device)
    return _ZERO_IDS[key]


def decode_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  cfg: LinearPlan | None = None) -> torch.Tensor:
    """out [M, N] (x's dtype) = x [M, K] @ w [N, K]^T for 1 <= M <= MAX_M; cfg: else plan(M, N, K)."""
    if not eligible(x, w):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype}: need [M, K] and "
                         f"a contiguous [N, K] of one dtype in {DTYPES}")
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"M={M}: decode_linear takes 1..{MAX_M} tokens")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [M={M}, N={N}] {x.dtype} with unit column stride")
    cfg = cfg or plan(M, N, K)
    ids = zero_ids(x.device)
    ws, cnt = (out, ids)
    if cfg.SPLIT_K > 1:
        ws, cnt = split_workspace(x.device, M * N, M * triton.cdiv(N, cfg.BLOCK_N))
    w3 = w.unsqueeze(0)                                                    # [1, N, K]: expert 0
    launch(
        moe_decode_down_kernel, (M * triton.cdiv(N, cfg.BLOCK_N), cfg.SPLIT_K),
        x, w3, out, ids, ids, ids, ids, ws, cnt,
        N, K, M,
        x.stride(0), x.stride(1), w3.stride(0), w3.stride(1), w3.stride(2),
        out.stride(0), out.stride(1), 0, 0,
        0, 0, 0,
        TOPK=1, MUL_ROUTED=False, A_MODE=0, W_SCALE=0, EVEN_N=K % cfg.BLOCK_K == 0,
        SWAP_AB=cfg.SWAP_AB, BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        FP8_PREROUND=False, USE_PDL=False, SPLIT_K=cfg.SPLIT_K, GROUP_N=0, GROUP_K=0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
