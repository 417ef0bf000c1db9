"""Attention on Hopper as vLLM 0.26 runs it: its default backend (FlashAttention 3) against its
Triton unified attention, each with its KV-cache write, for a standard (non-MLA) attention layer.

Per named attention shape (query heads, KV heads, head size), batch B and context L:
    decode   B sequences of L cached tokens, one new token each (the cache write, then attention
             over L + 1 keys), with the split-KV settings vLLM uses under full CUDA graphs
             (FA3: AOT scheduler metadata, at most 32 splits; Triton: the 3D kernel with 16
             softmax segments up to B = 128 // KV heads); FA3 also with one split
    prefill  one sequence of L new tokens (causal)
Both backends share one paged cache per layer ([blocks, KV heads, 16, 2 * head size], the layout
both use in 0.26). Every row is first checked: each backend's output, written into NaN-poisoned
buffers, against an fp32 reference on sequence 0 and against the other backend on every
sequence. Then timed as CUDA-graph replays over N_LAYERS caches with L2 flushed before each
call (in the model, a layer's weights evict the previous layer's cache): median us per layer.
Needs a CUDA GPU and vLLM with FA3.

    python bench/bench_attention.py [--shapes qwen3-30b-a3b,mixtral-8x7b] [--m 1,8,32,64]
                                    [--context 256,2048,8192] [--prefill 128,2048,8192] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.tuning.timing import time_graph  # noqa: E402


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer at TP = 1 (config.json: num_attention_heads, num_key_value_heads)."""

    heads: int
    kv_heads: int
    head_size: int = 128


SHAPES = {
    "qwen3-30b-a3b": AttentionShape(32, 4),
    "mixtral-8x7b": AttentionShape(32, 8),
}
BLOCK = 16                  # vLLM's default KV-cache block size on CUDA
N_LAYERS = 8
FA3_MAX_SPLITS = 32         # AttentionConfig.flash_attn_max_num_splits_for_cuda_graph
MAX_GRAPH_TOKENS = 512      # vLLM's largest CUDA-graph size here: up to it FA3 gets FA3_MAX_SPLITS, past it
                            # its own heuristic (num_splits 0)
MAX_ERR = 2e-2              # bf16 outputs of unit-scale values


@dataclass
class Problem:
    """One layer's paged cache and the step's inputs."""

    q: torch.Tensor            # [T, H, D] new tokens' queries
    k: torch.Tensor            # [T, Hkv, D] new keys
    v: torch.Tensor            # [T, Hkv, D]
    kv_cache: torch.Tensor     # [blocks, Hkv, BLOCK, 2 * D]
    slots: torch.Tensor        # [T] int64 cache slot of each new token
    block_table: torch.Tensor  # [B, blocks per sequence] int32
    cu_q: torch.Tensor         # [B + 1] int32
    seqlens: torch.Tensor      # [B] int32 keys per sequence after the write

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views [blocks, BLOCK, Hkv, D], as both backends take them."""
        D = self.q.shape[-1]
        return self.kv_cache.transpose(1, 2).split(D, dim=-1)


def make_problem(s: AttentionShape, B: int, cached: int, new: int, gen: torch.Generator,
                 dtype: torch.dtype = torch.bfloat16) -> Problem:
    """B sequences with `cached` tokens already in a random cache and `new` tokens this step, on
    gen's device; blocks in random order."""
    total, dev = cached + new, gen.device
    per_seq = -(-total // BLOCK)
    table = torch.randperm(B * per_seq, generator=gen, device=dev).to(torch.int32).view(B, per_seq)
    kv = torch.randn(B * per_seq, s.kv_heads, BLOCK, 2 * s.head_size, device=dev, dtype=dtype, generator=gen)
    pos = torch.arange(cached, total, device=dev)                              # [new]
    slots = (table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(-1)  # [B * new]
    T = B * new
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=gen)  # noqa: E731
    return Problem(rnd(T, s.heads, s.head_size), rnd(T, s.kv_heads, s.head_size),
                   rnd(T, s.kv_heads, s.head_size), kv, slots, table,
                   torch.arange(0, T + 1, new, device=dev, dtype=torch.int32),
                   torch.full((B,), total, device=dev, dtype=torch.int32))


def reference(p: Problem, s: AttentionShape, new: int) -> torch.Tensor:
    """fp32 causal attention of sequence 0's new tokens over its cache after the write: [new, H, D]."""
    key_cache, value_cache = p.caches()
    total = int(p.seqlens[0])
    rows = p.block_table[0].long()
    k = key_cache[rows].reshape(-1, s.kv_heads, s.head_size)[:total].float()     # [L, Hkv, D]
    v = value_cache[rows].reshape(-1, s.kv_heads, s.head_size)[:total].float()
    k[total - new:], v[total - new:] = p.k[:new].float(), p.v[:new].float()
    group = s.heads // s.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)          # [L, H, D]
    scores = torch.einsum("qhd,khd->hqk", p.q[:new].float(), k) / s.head_size ** 0.5
    q_pos = torch.arange(total - new, total, device=k.device)[:, None]
    scores = scores.masked_fill(torch.arange(total, device=k.device)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fa3_call(p: Problem, s: AttentionShape, new: int, splits: int) -> Callable[[torch.Tensor], None]:
    """vLLM's FlashAttention backend: reshape_and_cache_flash, then FA3 with AOT scheduler metadata."""
    from vllm.v1.attention.backends.fa_utils import (flash_attn_varlen_func, get_scheduler_metadata,
                                                     reshape_and_cache_flash)
    key_cache, value_cache = p.caches()
    one = torch.ones((), device="cuda", dtype=torch.float32)
    B, max_k = p.block_table.shape[0], int(p.seqlens.max())
    meta = get_scheduler_metadata(batch_size=B, max_seqlen_q=new, max_seqlen_k=max_k, num_heads_q=s.heads,
                                  num_heads_kv=s.kv_heads, headdim=s.head_size, cache_seqlens=p.seqlens,
                                  qkv_dtype=torch.bfloat16, cu_seqlens_q=p.cu_q, page_size=BLOCK, causal=True,
                                  num_splits=splits)

    def run(out: torch.Tensor) -> None:
        reshape_and_cache_flash(p.k, p.v, key_cache, value_cache, p.slots, "auto", one, one)
        flash_attn_varlen_func(q=p.q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=p.cu_q,
                               max_seqlen_q=new, seqused_k=p.seqlens, max_seqlen_k=max_k,
                               softmax_scale=s.head_size ** -0.5, causal=True, block_table=p.block_table,
                               scheduler_metadata=meta, num_splits=splits, fa_version=3)
    return run


def triton_call(p: Problem, s: AttentionShape, new: int) -> Callable[[torch.Tensor], None]:
    """vLLM's Triton backend: triton_reshape_and_cache_flash, then unified_attention (3D up to its
    threshold of sequences at decode, as its metadata builder sets it)."""
    from vllm.v1.attention.backends.triton_attn import MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    key_cache, value_cache = p.caches()
    one = torch.ones((), device="cuda", dtype=torch.float32)
    B, max_k = p.block_table.shape[0], int(p.seqlens.max())
    threshold = MIN_LAUNCH_GRID_SIZE_2D // s.kv_heads
    pad = triton.next_power_of_2(s.head_size)
    segm = torch.empty(threshold, s.heads, NUM_PAR_SOFTMAX_SEGMENTS, pad, device="cuda", dtype=torch.float32)
    segm_max = torch.empty(threshold, s.heads, NUM_PAR_SOFTMAX_SEGMENTS, device="cuda", dtype=torch.float32)
    segm_sum = torch.empty_like(segm_max)
    descale = one.expand(B, s.kv_heads)

    def run(out: torch.Tensor) -> None:
        triton_reshape_and_cache_flash(p.k, p.v, key_cache, value_cache, p.slots, "auto", one, one)
        unified_attention(q=p.q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=p.cu_q, max_seqlen_q=new,
                          seqused_k=p.seqlens, max_seqlen_k=max_k, softmax_scale=s.head_size ** -0.5,
                          causal=True, window_size=(-1, -1), block_table=p.block_table, softcap=0,
                          q_descale=None, k_descale=descale, v_descale=descale, seq_threshold_3D=threshold,
                          num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS, softmax_segm_output=segm,
                          softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)
    return run


def run_row(name: str, s: AttentionShape, B: int, cached: int, new: int, gen: torch.Generator) -> dict:
    """Check, then time, every backend variant on one (B, cached, new) step."""
    layers = [make_problem(s, B, cached, new, gen) for _ in range(N_LAYERS)]
    splits = FA3_MAX_SPLITS if B * new <= MAX_GRAPH_TOKENS else 0
    variants: dict[str, Callable[[Problem], Callable[[torch.Tensor], None]]] = {
        "fa3": lambda p: fa3_call(p, s, new, splits),
        "triton": lambda p: triton_call(p, s, new),
    }
    if new == 1:
        variants["fa3_1split"] = lambda p: fa3_call(p, s, new, 1)
    row: dict[str, Any] = {"shape": name, **asdict(s), "phase": "decode" if new == 1 else "prefill",
                           "B": B, "context": cached + new}
    outs = {}
    for v, make in variants.items():
        out = torch.full_like(layers[0].q, float("nan"))
        make(layers[0])(out)
        torch.cuda.synchronize()
        err = float((out[:new].float() - reference(layers[0], s, new)).abs().max())
        if not err <= MAX_ERR:                                 # NaN fails too
            raise AssertionError(f"{name} B={B} L={cached + new} {v}: max err {err:.3g} vs fp32")
        outs[v] = out
        row[f"{v}_err"] = round(err, 5)
    for v, out in outs.items():
        diff = float((out.float() - outs["fa3"].float()).abs().max())
        if not diff <= MAX_ERR:
            raise AssertionError(f"{name} B={B} L={cached + new} {v}: differs from fa3 by {diff:.3g}")
    for v, make in variants.items():
        calls = [make(p) for p in layers]
        bufs = [torch.empty_like(p.q) for p in layers]
        row[f"{v}_us"] = round(time_graph(lambda i: calls[i](bufs[i]), N_LAYERS, flush_l2=True), 2)
    row["triton_over_fa3"] = round(row["fa3_us"] / row["triton_us"], 3)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ints = lambda t: [int(x) for x in t.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog="bench_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--m", type=ints, default=[1, 8, 32, 64], help="decode batch sizes")
    ap.add_argument("--context", type=ints, default=[256, 2048, 8192], help="decode context lengths")
    ap.add_argument("--prefill", type=ints, default=[128, 2048, 8192], help="prefill prompt lengths")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        print(f"bench_attention: unknown shapes {unknown}; known: {sorted(SHAPES)}", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        steps = [(B, L - 1, 1) for L in args.context for B in args.m] + [(1, 0, L) for L in args.prefill]
        for B, cached, new in steps:
            rows.append(run_row(name, s, B, cached, new, gen))
            torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
