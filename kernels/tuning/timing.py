"""Timing primitives for MoE kernels on the GPU: CUDA-graph replay of rotating input sets.

time_graph captures fn(0..n_sets-1) into one graph and reports the median over replays, so
launch overhead is what serving sees (decode runs under CUDA graphs) and input sets larger
than L2 rotate. On CPU it falls back to wall clock (the interpreter pipeline tests).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from moe_serve.kernels.moe import quant_format
from moe_serve.kernels.moe.fp8_scales import Fp8Scales, quantize_weights
from moe_serve.kernels.moe.fused_moe import fused_moe


def time_graph(fn: Callable[[int], Any], n_sets: int, replays: int = 20, flush_l2: bool = False) -> float:
    """Median us per call: capture fn(0..n_sets-1) into one CUDA graph, replay `replays` times.

    flush_l2: before each call the graph zeroes a buffer of twice the L2 size, so no call finds
    the previous call's weights in L2 (in serving, the next MoE layer has other weights); the
    median of a graph of the flushes alone is subtracted. Falls back to wall clock (no graph) on
    CPU, where flush_l2 is refused."""
    if not torch.cuda.is_available():
        if flush_l2:
            raise ValueError("flush_l2 needs a CUDA device")
        t = []
        for r in range(max(2, replays // 5)):
            t0 = time.perf_counter()
            for i in range(n_sets):
                fn(i)
            t.append((time.perf_counter() - t0) / n_sets * 1e6)
        return statistics.median(t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_sets):  # eager warm-up: compiles and allocator warm
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if not flush_l2:
        return _replay_us(lambda: [fn(i) for i in range(n_sets)], replays) / n_sets
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    buf = torch.empty(2 * l2 // 4, dtype=torch.int32, device="cuda")
    both = _replay_us(lambda: [(buf.zero_(), fn(i)) for i in range(n_sets)], replays)
    flushes = _replay_us(lambda: [buf.zero_() for _ in range(n_sets)], replays)
    return (both - flushes) / n_sets


def _replay_us(body: Callable[[], Any], replays: int) -> float:
    """Median us of one replay of a CUDA graph of body()."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    us = replay_median_us(g, replays)
    del g
    return us


def replay_median_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median us of one replay of a captured CUDA graph, CUDA events around each of `replays`."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def make_problem(E: int, N: int, K: int, topk: int, M: int, dtype: str, n_sets: int,
                 device: str, seed: int = 0, weights: tuple | None = None) -> dict[str, Any]:
    """Random never-zero inputs, n_sets routings (softmax of random logits, top-k). dtype: a
    moe_serve.kernels.moe.quant_format key ('bf16'; fp8: per-tensor weights with static activation scales,
    per-channel with per-token ones, or block scales with per-group ones)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    fp8 = quant_format.is_fp8(dtype)
    if weights is None:  # generated on the device (DeepSeek-V3 shard: 2.8 GB in bf16)
        gd = torch.Generator(device=device).manual_seed(seed)
        w1 = torch.randn(E, 2 * N, K, generator=gd, device=device).mul_(K ** -0.5)
        w2 = torch.randn(E, K, N, generator=gd, device=device).mul_(N ** -0.5)
        if fp8:
            weights = (*quantize_weights(w1, dtype), *quantize_weights(w2, dtype))
            weights = (weights[0], weights[2], weights[1], weights[3])
        else:
            weights = (w1.to(torch.bfloat16), w2.to(torch.bfloat16), None, None)
        del gd
    sets = []
    for _ in range(n_sets):
        x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
        p = torch.softmax(torch.randn(M, E, generator=g), -1)
        tw, ids = p.topk(topk, -1)
        sets.append((x, tw.float().to(device), ids.to(torch.int32).to(device)))
    scales = None
    if fp8 and dtype == quant_format.FP8:
        scales = Fp8Scales(weights[2], weights[3], torch.tensor(0.02, device=device),
                           torch.tensor(0.02, device=device))
    elif fp8:
        scales = Fp8Scales(weights[2], weights[3], block_shape=quant_format.block_shape(dtype),
                           per_token_act=dtype == quant_format.PER_TOKEN)
    return {"weights": weights, "sets": sets, "fp8": scales}


def time_ours(prob: dict[str, Any], cfg: dict | None, replays: int = 20) -> float:
    w1, w2 = prob["weights"][:2]
    outs = [torch.empty_like(x) for x, _, _ in prob["sets"]]

    def call(i: int) -> None:
        x, tw, ids = prob["sets"][i]
        fused_moe(x, w1, w2, tw, ids, fp8=prob["fp8"], out=outs[i], config=cfg)
    return time_graph(call, len(prob["sets"]), replays)


def time_vllm(prob: dict[str, Any], replays: int = 20) -> float | None:
    """vLLM's fused_experts on the same problem (None when vLLM is absent)."""
    from moe_serve.kernels.moe import vllm_kernels

    fx = vllm_kernels.fused_experts()
    if fx is None:
        return None
    fused_experts, qcfg = fx
    w1, w2, s1, s2 = prob["weights"]
    quant = None
    q = prob["fp8"]
    if q is not None:
        quant = qcfg(w1_scale=s1, w2_scale=s2, a1_scale=q.a1_scale, a2_scale=q.a2_scale,
                     per_act_token_quant=q.per_token_act, per_out_ch_quant=q.per_token_act,
                     block_shape=list(q.block_shape) if q.block_shape else None)

    def call(i: int) -> None:
        x, tw, ids = prob["sets"][i]
        fused_experts(x, w1, w2, tw, ids, quant_config=quant)
    return time_graph(call, len(prob["sets"]), replays)


_FLOAT = {"fp16": torch.float16, "fp32": torch.float32}


def make_vllm_problem(E: int, N: int, K: int, topk: int, M: int, fmt: str, n_sets: int,
                      device: str, seed: int = 0, weights: tuple | None = None) -> dict[str, Any]:
    """make_problem with unquantized fp16 / fp32 formats in their own dtype (hidden states and
    weights; make_problem's are bf16), as a model of that dtype hands them to vLLM's experts."""
    prob = make_problem(E, N, K, topk, M, fmt, n_sets, device, seed, weights)
    dt = _FLOAT.get(fmt)
    if dt is not None:
        w1, w2 = (w.to(dt) for w in prob["weights"][:2])
        prob["weights"] = (w1, w2, None, None)
        prob["sets"] = [(x.to(dt), tw, ids) for x, tw, ids in prob["sets"]]
    return prob


def _pointer(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A 0-d scale as shape [1]: Triton passes a 0-d tensor argument as a scalar, not a pointer."""
    return scale.reshape(1) if scale is not None and scale.dim() == 0 else scale


def vllm_runner(prob: dict[str, Any], config: dict | None,
                experts: Callable | None = None) -> Callable[[int], torch.Tensor]:
    """call(i) -> vLLM's fused_experts on input set i of prob ([M, K] out), with `config` forced
    through vLLM's override_config (None: the config vLLM picks itself). `experts` stands in for
    fused_experts (same signature; the CPU tests)."""
    from moe_serve.kernels.moe import vllm_kernels
    from moe_serve.kernels.tuning.vllm_space import OVERRIDE_CONFIG

    fx, override = vllm_kernels.fused_experts(), vllm_kernels.load(OVERRIDE_CONFIG)
    if fx is None or override is None:
        raise RuntimeError("vLLM's fused_experts / override_config are not importable")
    fused_experts, qcfg = fx
    fused_experts = experts or fused_experts
    w1, w2, s1, s2 = prob["weights"]
    q = prob["fp8"]
    quant = None if q is None else qcfg(
        w1_scale=s1, w2_scale=s2, a1_scale=_pointer(q.a1_scale), a2_scale=_pointer(q.a2_scale),
        per_act_token_quant=q.per_token_act, per_out_ch_quant=q.per_token_act,
        block_shape=list(q.block_shape) if q.block_shape else None)

    def call(i: int) -> torch.Tensor:
        x, tw, ids = prob["sets"][i]
        if config is None:
            return fused_experts(x, w1, w2, tw, ids, quant_config=quant)
        with override(dict(config)):
            return fused_experts(x, w1, w2, tw, ids, quant_config=quant)
    return call


def time_vllm_config(prob: dict[str, Any], config: dict | None, replays: int = 20,
                     experts: Callable | None = None) -> float:
    """us per call of vLLM's fused_experts with `config` forced (vllm_runner), CUDA-graph replay
    of prob's rotating input sets (time_graph)."""
    return time_graph(vllm_runner(prob, config, experts), len(prob["sets"]), replays)
