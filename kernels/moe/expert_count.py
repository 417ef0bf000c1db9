"""Expert load counting: add one MoE call's routing into a layer's per-expert token counts.

For topk_ids [M, topk] (the experts each token is routed to) and a layer's counts [E] (int64):

    counts[e] += #{(m, j) : expert(topk_ids[m, j]) == e, m < num_tokens}
    out_of_range += #{(m, j) : expert(topk_ids[m, j]) outside [0, E), m < num_tokens}

num_tokens (int32 [1], on the device) is the number of real tokens of the forward: under CUDA
graphs a batch is padded to its captured size, and the padding rows' routing must not count.
expert(i) is i itself, or with vLLM's expert-parallel load balancer (EPLB), whose routers return
physical expert slots (a logical expert may have several replicas), the logical expert of slot i:
expert_map [P] (physical_to_logical, built on the device from vLLM's current placement at every
call, so a rearrangement counts from its first step on; -1: no logical expert). Ids that name no
expert (-1 marks a dropped slot, a slot past the map, a fused shared or "zero" expert) are
counted in out_of_range [1] (int64) where one is given, never in counts.

count_experts_kernel   grid (cdiv(M * topk, BLOCK),)
    One program per BLOCK routing slots: masked loads, one atomic add per counted slot, one per
    program for the out-of-range ones. No host sync: recorded by CUDA-graph capture, it adds on
    every replay. Where our router serves a call (moe_serve.kernels.moe.router_topk with `counts`), the router
    kernel adds the same counts itself and this launch is not needed.

On CPU (vLLM's CPU engine, where torch.compile traces the MoE layer) the same sums are one
`index_add_` and one `add_` (count_experts_torch), which torch.compile records as in-place updates.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.moe.launch import jit, launch

BLOCK = 1024


@jit(do_not_specialize=["numel"])
def count_experts_kernel(ids_ptr, num_tokens_ptr, map_ptr,          # in: routing, real tokens, slot -> expert
                         counts_ptr, out_of_range_ptr,               # out: added into
                         numel, E, P,                                # routing slots, experts, map entries
                         TOPK: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr, HAS_MAP: tl.constexpr,
                         HAS_OUT_OF_RANGE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)        # routing slots m * TOPK + j
    mask = offs < numel
    if HAS_NUM_TOKENS:
        mask &= offs // TOPK < tl.load(num_tokens_ptr)
    e = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int64)
    if HAS_MAP:                                                  # physical slot -> logical expert
        placed = mask & (e >= 0) & (e < P)
        e = tl.load(map_ptr + tl.where(placed, e, 0), mask=placed, other=-1).to(tl.int64)
    valid = mask & (e >= 0) & (e < E)
    tl.atomic_add(counts_ptr + tl.where(valid, e, 0), tl.full((BLOCK,), 1, tl.int64), mask=valid, sem="relaxed")
    if HAS_OUT_OF_RANGE:
        stray = tl.sum((mask & ~valid).to(tl.int64), axis=0)
        tl.atomic_add(out_of_range_ptr, stray, mask=stray > 0, sem="relaxed")


def _check(topk_ids: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor | None,
           out_of_range: torch.Tensor | None, expert_map: torch.Tensor | None) -> None:
    if topk_ids.dim() != 2 or counts.dim() != 1 or counts.dtype != torch.int64 or not counts.is_contiguous():
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} must be [M, topk], counts {tuple(counts.shape)} "
                         f"{counts.dtype} a contiguous int64 [E]")
    if num_tokens is not None and (num_tokens.numel() != 1 or num_tokens.dtype != torch.int32):
        raise ValueError("num_tokens must be an int32 tensor of one element")
    if out_of_range is not None and (out_of_range.numel() != 1 or out_of_range.dtype != torch.int64):
        raise ValueError("out_of_range must be an int64 tensor of one element")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype.is_floating_point
                                   or not expert_map.is_contiguous()):
        raise ValueError(f"expert_map {tuple(expert_map.shape)} {expert_map.dtype} must be a contiguous integer [P]")


def count_experts_triton(topk_ids: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor | None = None, *,
                         out_of_range: torch.Tensor | None = None, expert_map: torch.Tensor | None = None) -> None:
    """counts [E] (and out_of_range [1]) += this call's tokens per expert (module doc), one Triton launch."""
    _check(topk_ids, counts, num_tokens, out_of_range, expert_map)
    ids = topk_ids.contiguous()
    numel = ids.numel()
    if numel == 0:
        return
    launch(count_experts_kernel, (triton.cdiv(numel, BLOCK),), ids,
           num_tokens if num_tokens is not None else counts, expert_map if expert_map is not None else counts,
           counts, out_of_range if out_of_range is not None else counts,
           numel, counts.numel(), expert_map.numel() if expert_map is not None else 0,
           TOPK=ids.shape[1], HAS_NUM_TOKENS=num_tokens is not None, HAS_MAP=expert_map is not None,
           HAS_OUT_OF_RANGE=out_of_range is not None, BLOCK=BLOCK, num_warps=4)


def count_experts_torch(topk_ids: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor | None = None, *,
                        out_of_range: torch.Tensor | None = None, expert_map: torch.Tensor | None = None) -> None:
    """The same sums as count_experts_triton with torch ops (CPU; traceable by torch.compile)."""
    _check(topk_ids, counts, num_tokens, out_of_range, expert_map)
    M, topk = topk_ids.shape
    E = counts.numel()
    ids = topk_ids.reshape(-1).to(torch.int64)                    # [M * topk]
    real = torch.ones_like(ids, dtype=torch.bool)
    if num_tokens is not None:
        rows = torch.arange(M, device=ids.device).repeat_interleave(topk)
        real = rows < num_tokens.to(ids.device)
    if expert_map is not None:
        placed = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(placed, expert_map[torch.where(placed, ids, 0)].to(torch.int64), -1)
    valid = real & (ids >= 0) & (ids < E)
    counts.index_add_(0, torch.where(valid, ids, 0), valid.to(torch.int64))
    if out_of_range is not None:
        out_of_range.add_((real & ~valid).sum())


def count_experts(topk_ids: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor | None = None, *,
                  out_of_range: torch.Tensor | None = None, expert_map: torch.Tensor | None = None) -> None:
    """counts [E] (and out_of_range [1]) += this call's tokens per expert: Triton on CUDA tensors,
    torch elsewhere."""
    count = count_experts_triton if counts.is_cuda else count_experts_torch
    count(topk_ids, counts, num_tokens, out_of_range=out_of_range, expert_map=expert_map)


def physical_to_logical(placement: torch.Tensor, slots: int) -> torch.Tensor:
    """The logical expert of each of `slots` physical expert slots ([slots] int64, -1 where none)
    from vLLM's EPLB placement [E, R] (logical_to_physical_map: each logical expert's physical
    replicas, padded with -1). Torch ops on placement's device (recorded by CUDA graphs, traced by
    torch.compile), so the map is the placement's as it is at every call."""
    E, R = placement.shape
    out = torch.full((slots + 1,), -1, dtype=torch.int64, device=placement.device)   # [slots + 1]: + a sink
    where = torch.where((placement >= 0) & (placement < slots), placement.to(torch.int64), slots).reshape(-1)
    owners = torch.arange(E, device=placement.device).repeat_interleave(R)          # [E * R]
    out.scatter_(0, where, owners)
    return out[:slots]
