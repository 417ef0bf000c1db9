"""Expert load counting: add one MoE call's routing into a layer's per-expert token counts.

For topk_ids [M, topk] (the experts each token is routed to) and a layer's counts [E] (int64):

    counts[e] += #{(m, j) : topk_ids[m, j] == e, m < num_tokens}

num_tokens (int32 [1], on the device) is the number of real tokens of the forward: under CUDA
graphs a batch is padded to its captured size, and the padding rows' routing must not count.
Ids outside [0, E) (none in vLLM's routers; -1 would mark a dropped slot) are skipped.

count_experts_kernel   grid (cdiv(M * topk, BLOCK),)
    One program per BLOCK routing slots: masked loads, one atomic add per slot. No host sync:
    recorded by CUDA-graph capture, it adds on every replay. Where our router serves a call
    (kernels.moe.router_topk with `counts`), the router kernel adds the same counts itself and
    this launch is not needed.

On CPU (vLLM's CPU engine, where torch.compile traces the MoE layer) the same sum is one
`index_add_` (count_experts_torch), which torch.compile records as an in-place update.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.launch import jit, launch

BLOCK = 1024


@jit(do_not_specialize=["numel"])
def count_experts_kernel(ids_ptr, counts_ptr, num_tokens_ptr, numel, E,
                         TOPK: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)        # routing slots m * TOPK + j
    mask = offs < numel
    if HAS_NUM_TOKENS:
        mask &= offs // TOPK < tl.load(num_tokens_ptr)
    e = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int64)
    mask &= (e >= 0) & (e < E)
    tl.atomic_add(counts_ptr + tl.where(mask, e, 0), tl.full((BLOCK,), 1, tl.int64), mask=mask, sem="relaxed")


def _check(topk_ids: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor | None) -> None:
    if topk_ids.dim() != 2 or counts.dim() != 1 or counts.dtype != torch.int64 or not counts.is_contiguous():
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} must be [M, topk], counts {tuple(counts.shape)} "
                         f"{counts.dtype} a contiguous int64 [E]")
    if num_tokens is not None and (num_tokens.numel() != 1 or num_tokens.dtype != torch.int32):
        raise ValueError("num_tokens must be an int32 tensor of one element")


def count_experts_triton(topk_ids: torch.Tensor, counts: torch.Tensor,
                         num_tokens: torch.Tensor | None = None) -> None:
    """counts [E] += this call's tokens per expert (module doc), one Triton launch."""
    _check(topk_ids, counts, num_tokens)
    ids = topk_ids.contiguous()
    numel = ids.numel()
    if numel == 0:
        return
    launch(count_experts_kernel, (triton.cdiv(numel, BLOCK),), ids, counts,
           num_tokens if num_tokens is not None else counts, numel, counts.numel(),
           TOPK=ids.shape[1], HAS_NUM_TOKENS=num_tokens is not None, BLOCK=BLOCK, num_warps=4)


def count_experts_torch(topk_ids: torch.Tensor, counts: torch.Tensor,
                        num_tokens: torch.Tensor | None = None) -> None:
    """The same sum as count_experts_triton with torch ops (CPU; traceable by torch.compile)."""
    _check(topk_ids, counts, num_tokens)
    M, topk = topk_ids.shape
    E = counts.numel()
    ids = topk_ids.reshape(-1).to(torch.int64)                    # [M * topk]
    valid = (ids >= 0) & (ids < E)
    if num_tokens is not None:
        rows = torch.arange(M, device=ids.device).repeat_interleave(topk)
        valid &= rows < num_tokens.to(ids.device)
    counts.index_add_(0, torch.where(valid, ids, 0), valid.to(torch.int64))


def count_experts(topk_ids: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
    """counts [E] += this call's tokens per expert: Triton on CUDA tensors, torch elsewhere."""
    if counts.is_cuda:
        count_experts_triton(topk_ids, counts, num_tokens)
    else:
        count_experts_torch(topk_ids, counts, num_tokens)
