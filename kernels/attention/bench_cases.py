"""Kernel-level benchmark case of decode attention: for B sequences of `context` tokens in a
paged cache, a `Pair` (moe_serve.kernels.fused.bench_cases) of our one-launch kernel
(decode.py) against the attention a decode step runs today, each a zero-argument callable to be
captured in a CUDA graph, and the float64 output to check both against.

`unfused` is vLLM's FlashAttention 3 as its backend calls it for a decode batch under full CUDA
graphs on Hopper: `flash_attn_varlen_func` with the ahead-of-time scheduler metadata and at most
`flash_attn_max_num_splits_for_cuda_graph` (32) splits (the split-KV combine runs inside it).
Baselines by name where vLLM's GPU kernels import: "fa3_one_split" (the same with one split: no
combine), "triton_unified" (vLLM's Triton backend's `unified_attention`, its 3D split-softmax
path below 128 / Hkv sequences, as its metadata builder sets it up); and our kernel at other
settings than its defaults (VARIANTS: "ours_<name>"), the data for choosing them. Off a GPU (dry runs)
`unfused` is torch attention over the gathered context, and there are no baselines.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from moe_serve.kernels.attention.decode import decode_attention
from moe_serve.kernels.fused.bench_cases import Pair

FA3_MAX_SPLITS = 32              # vLLM's AttentionConfig.flash_attn_max_num_splits_for_cuda_graph
TRITON_GRID_2D = 128             # vLLM's triton_attn MIN_LAUNCH_GRID_SIZE_2D
TRITON_SEGMENTS = 16             # and NUM_PAR_SOFTMAX_SEGMENTS
VARIANTS = {  # our kernel at other settings (decode_attention's keyword arguments)
    "n16": {"block_n": 16, "min_chunk": 16}, "n64": {"block_n": 64, "min_chunk": 64},
    "c64": {"min_chunk": 64}, "c128": {"min_chunk": 128}, "c256": {"min_chunk": 256},
    "s8": {"num_splits": 8}, "s16": {"num_splits": 16}, "s32": {"num_splits": 32},
    "w8": {"num_warps": 8}, "one_split": {"num_splits": 1},
    "t8": {"split_tile": 8}, "t4": {"split_tile": 4},
}


@dataclass(frozen=True)
class Inputs:
    """q [B, Hq, D]; key / value cache [blocks, block_size, Hkv, D] (the halves of one flash-layout
    tensor); block_table [B, pages] int32 (pages scattered over the cache); seq_lens [B] int32."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    scale: float


def make_inputs(B: int, Hq: int, Hkv: int, D: int, context: int, block_size: int = 16,
                dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0) -> Inputs:
    """Fresh random inputs: every sequence `context` tokens long, its pages a random choice of the
    cache's blocks (B * pages of them, plus one spare)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-context // block_size)
    blocks = B * pages + 1
    kv = torch.randn(2, blocks, block_size, Hkv, D, generator=g).to(dtype).to(device)
    table = torch.randperm(blocks, generator=g)[:B * pages].view(B, pages).to(torch.int32).to(device)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    lens = torch.full((B,), context, dtype=torch.int32, device=device)
    return Inputs(q, kv[0], kv[1], table, lens, D ** -0.5)


def float64_attention(x: Inputs) -> torch.Tensor:
    """out [B, Hq, D] in float64: softmax(scale q K^T) V over each sequence's gathered context."""
    B, Hq, D = x.q.shape
    bs, G = x.key_cache.shape[1], Hq // x.key_cache.shape[2]
    out = torch.empty(B, Hq, D, dtype=torch.float64, device=x.q.device)
    for b in range(B):
        t = torch.arange(int(x.seq_lens[b]), device=x.q.device)
        rows = x.block_table[b, t // bs].long(), t % bs
        k = x.key_cache[rows].double().repeat_interleave(G, 1)             # [L, Hq, D]
        v = x.value_cache[rows].double().repeat_interleave(G, 1)
        p = (torch.einsum("hd,lhd->hl", x.q[b].double(), k) * x.scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", p, v)
    return out


def _torch_attention(x: Inputs, out: torch.Tensor) -> torch.Tensor:
    out.copy_(float64_attention(x).to(out.dtype))
    return out


def _fa3(x: Inputs, out: torch.Tensor, max_splits: int) -> Any:
    """vLLM's FA3 decode call with its scheduler metadata (built once: per step, not per layer)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    B, Hq, D = x.q.shape
    Hkv, bs = x.key_cache.shape[2], x.key_cache.shape[1]
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=x.q.device)
    context = int(x.seq_lens.max())
    meta = get_scheduler_metadata(batch_size=B, max_seqlen_q=1, max_seqlen_k=context, num_heads_q=Hq,
                                  num_heads_kv=Hkv, headdim=D, cache_seqlens=x.seq_lens, qkv_dtype=x.q.dtype,
                                  cu_seqlens_q=cu_q, page_size=bs, causal=True, window_size=(-1, -1),
                                  num_splits=max_splits)

    def run() -> torch.Tensor:
        flash_attn_varlen_func(q=x.q, k=x.key_cache, v=x.value_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                               seqused_k=x.seq_lens, max_seqlen_k=context, softmax_scale=x.scale, causal=True,
                               block_table=x.block_table, scheduler_metadata=meta, fa_version=3,
                               num_splits=max_splits)
        return out
    return run


def _triton_unified(x: Inputs, out: torch.Tensor) -> Any:
    """vLLM's Triton backend's kernel with the buffers its metadata builder allocates."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    B, Hq, D = x.q.shape
    Hkv = x.key_cache.shape[2]
    threshold = TRITON_GRID_2D // Hkv
    padded = 1 << (D - 1).bit_length()
    segm_out = torch.empty(threshold, Hq, TRITON_SEGMENTS, padded, dtype=torch.float32, device=x.q.device)
    segm_max = torch.empty(threshold, Hq, TRITON_SEGMENTS, dtype=torch.float32, device=x.q.device)
    segm_sum = torch.empty_like(segm_max)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=x.q.device)
    context = int(x.seq_lens.max())

    def run() -> torch.Tensor:
        unified_attention(q=x.q, k=x.key_cache, v=x.value_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                          seqused_k=x.seq_lens, max_seqlen_k=context, softmax_scale=x.scale, causal=True,
                          window_size=(-1, -1), block_table=x.block_table, softcap=0, q_descale=None,
                          k_descale=None, v_descale=None, seq_threshold_3D=threshold,
                          num_par_softmax_segments=TRITON_SEGMENTS, softmax_segm_output=segm_out,
                          softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)
        return out
    return run


def decode_attention_pair(x: Inputs) -> Pair:
    """Ours against vLLM's FA3 as served (module doc); on a CPU against torch attention."""
    outs = [torch.full_like(x.q, float("nan")) for _ in range(4 + len(VARIANTS))]

    def ours(out: torch.Tensor, **settings: Any) -> Any:
        return lambda: decode_attention(x.q, x.key_cache, x.value_cache, x.block_table, x.seq_lens, x.scale, out=out,
                                        **settings)
    fused = ours(outs[0])

    B, Hq, D = x.q.shape
    cache_bytes = int(x.seq_lens.sum()) * x.key_cache.shape[2] * D * 2 * x.key_cache.element_size()
    moved = cache_bytes + 2 * x.q.numel() * x.q.element_size()
    if x.q.device.type != "cuda":
        return Pair(fused, lambda: _torch_attention(x, outs[1]), bytes=moved)
    others = {f"ours_{name}": ours(outs[4 + i], **settings) for i, (name, settings) in enumerate(VARIANTS.items())}
    with contextlib.suppress(ImportError):
        others["fa3_one_split"] = _fa3(x, outs[2], 1)
    with contextlib.suppress(ImportError):
        others["triton_unified"] = _triton_unified(x, outs[3])
    return Pair(fused, _fa3(x, outs[1], FA3_MAX_SPLITS), others, bytes=moved)
