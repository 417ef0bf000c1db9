"""The memory floor of a decode MoE layer: the time to stream its expert bytes once.

A plain Triton read kernel sums `nbytes` of int32 words (so nothing is skipped) over
`n_sets` rotating buffers larger than L2, replayed from a CUDA graph; the floor is the best
over a few grid and block sizes. Compare a kernel with the floor for *its* byte count: small
reads never reach the large-copy ceiling (launch, ramp and drain are part of the floor).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

L2_BYTES = 50 * 2 ** 20          # H200: 50 MiB L2; rotated sets together exceed 2x this


@triton.jit
def _read_kernel(src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    """dst[pid] = sum of src words pid*BLOCK + i*grid*BLOCK (grid-stride; int32 adds)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_words, step):
        o = start + offs
        acc += tl.load(src_ptr + o, mask=o < n_words, other=0)
    tl.store(dst_ptr + pid, tl.sum(acc, axis=0))


def floor_us(nbytes: int, replays: int = 20, grids: tuple[int, ...] = (132, 264, 528, 1056),
             blocks: tuple[int, ...] = (1024, 4096)) -> dict[str, float]:
    """Best median us to read nbytes once, and the (grid, block) that reached it."""
    from moe_serve.kernels.tuning.timing import time_graph

    words = max(1, nbytes // 4)
    n_sets = max(2, min(64, -(-2 * L2_BYTES // max(nbytes, 1)) + 1))
    bufs = [torch.randint(-1000, 1000, (words,), dtype=torch.int32, device="cuda")
            for _ in range(n_sets)]
    dst = torch.empty(max(grids), dtype=torch.int32, device="cuda")
    best = {"floor_us": float("inf")}
    for grid in grids:
        for block in blocks:
            def call(i: int, grid=grid, block=block) -> None:
                _read_kernel[(grid,)](bufs[i], dst, words, BLOCK=block, num_warps=8)
            t = time_graph(call, n_sets, replays)
            if t < best["floor_us"]:
                best = {"floor_us": t, "floor_grid": grid, "floor_block": block}
    del bufs
    return {**best, "floor_bytes": words * 4, "floor_sets": n_sets}
