"""Token alignment for the fused MoE: one single-program Triton kernel, no host sync.

Given topk_ids [M, topk] it writes, for a block size BLOCK_M:
  sorted_ids   [max_padded] int32: token-slot ids (m * topk + j) grouped by expert, each
               expert's run padded to a multiple of BLOCK_M with the sentinel T = M * topk;
  expert_ids   [max_blocks] int32: expert of each BLOCK_M block (blocks past the end: E);
  num_post_pad [1] int32: total padded length (multiple of BLOCK_M).
Output sizes depend only on (M, topk, E, BLOCK_M), so the call is CUDA-graph capturable.
Order inside one expert's run follows the token-slot order (deterministic).

On a GPU with vLLM installed, `moe_align` uses vLLM's CUDA op instead (same outputs, one
multi-block kernel: the single-program scan here grows linearly with M * topk).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.moe import vllm_kernels
from moe_serve.kernels.moe.launch import jit, launch


def max_padded_len(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded length: each of at most min(T, E) hit experts adds < BLOCK_M pad."""
    return num_slots + min(num_slots, num_experts) * (block_m - 1)


@jit(do_not_specialize=["num_valid"])
def moe_align_kernel(
    # pointers
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    # sizes
    num_valid, E,
    # constexprs
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Histogram -> padded exclusive scan -> expert per block -> stable scatter."""
    e_range = tl.arange(0, E_PAD)                                   # [E_PAD]
    t_range = tl.arange(0, BLOCK_T)                                 # [BT]
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for t0 in range(0, num_valid, BLOCK_T):
        t = t0 + t_range
        ids = tl.load(ids_ptr + t, mask=t < num_valid, other=E_PAD).to(tl.int32)
        onehot = (ids[:, None] == e_range[None, :]).to(tl.int32)    # [BT, E_PAD]
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M            # [E_PAD]
    cum_end = tl.cumsum(padded, axis=0)                             # [E_PAD] inclusive
    starts = cum_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)

    # Pad slots get the sentinel num_valid; real slots are overwritten after the barrier.
    for p0 in range(0, total, BLOCK_T):
        p = p0 + t_range
        tl.store(sorted_ptr + p, tl.zeros([BLOCK_T], tl.int32) + num_valid, mask=p < total)
    # Expert of block b = number of experts whose padded run ends at or before b * BLOCK_M.
    for b0 in range(0, total // BLOCK_M, BLOCK_T):
        b = b0 + t_range
        ends_before = (cum_end[None, :] <= b[:, None] * BLOCK_M) & (e_range[None, :] < E)
        e_of_b = tl.sum(ends_before.to(tl.int32), axis=1)           # [BT]
        tl.store(expert_ids_ptr + b, e_of_b, mask=b < total // BLOCK_M)
    tl.debug_barrier()

    running = starts                                                # [E_PAD] next free slot
    for t0 in range(0, num_valid, BLOCK_T):
        t = t0 + t_range
        ids = tl.load(ids_ptr + t, mask=t < num_valid, other=E_PAD).to(tl.int32)
        onehot = (ids[:, None] == e_range[None, :]).to(tl.int32)    # [BT, E_PAD]
        rank = tl.cumsum(onehot, axis=0) - onehot                   # exclusive, per expert
        pos = tl.sum(onehot * (rank + running[None, :]), axis=1)    # [BT]
        tl.store(sorted_ptr + pos, t, mask=t < num_valid)
        running += tl.sum(onehot, axis=0)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align [M, topk] expert ids to BLOCK_M. Returns (sorted_ids, expert_ids, num_post_pad)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [M, topk], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    op = vllm_kernels.align_op() if ids.is_cuda else None
    if op is not None:
        return op(ids, block_m, num_experts)
    num_slots = ids.numel()
    max_padded = max_padded_len(num_slots, num_experts, block_m)
    max_blocks = triton.cdiv(max_padded, block_m)
    dev = ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    block_t = max(16, min(256, 8192 // e_pad))
    launch(
        moe_align_kernel, (1,), ids, sorted_ids, expert_ids, num_post,
        num_slots, num_experts,
        E_PAD=e_pad, BLOCK_M=block_m, BLOCK_T=block_t, num_warps=8 if e_pad >= 128 else 4,
    )
    return sorted_ids, expert_ids, num_post
