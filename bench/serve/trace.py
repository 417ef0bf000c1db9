"""GPU kernel time per decode step from vLLM's torch-profiler traces.

`summarize_trace` reduces one Chrome trace to per-kernel counts and total µs plus the GPU busy
time (the union of kernel, memcpy and memset intervals). Two bursts, one of `short` and one of
`long` output tokens, give per decode step (long minus short over the extra tokens, which cancels
prefill and per-request costs) the time of each KERNEL_CLASSES class, GPU busy, and the measured
step minus busy (GPU idle): `per_step_classes`. Kernels that overlap (as with PDL) count in each
class; busy is the union. `kernel_class` sorts a kernel by name: the MoE kernels into expert GEMMs,
router top-k and alignment (a router's own GEMM is a cuBLAS GEMM whose name does not tell it
apart, so it counts as a dense GEMM), the rest into attention, dense GEMMs, norms/elementwise,
sampling, memcpy/memset and other.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Kernels of the MoE layers' expert computation and routing, ours, vLLM's and FlashInfer's (its
# CUTLASS fused MoE: TensorRT-LLM's cutlass_kernels helpers and CUTLASS grouped GEMMs, whose
# mangled names carry GroupProblemShape). Elementwise kernels a MoE layer shares with other layers
# (vLLM's act_and_mul, scaled_fp8_quant) count as other.
MOE_KERNELS = re.compile(r"moe|expert|topk|MoeFC|expandInputRows|finalizeMoe|cutlass_kernels::|"
                         r"GroupProblemShape", re.I)
# torch's own top-k and sort kernels serve the sampler (top-k/top-p), not the MoE router.
SAMPLER_TOPK = re.compile(r"gatherTopK|sbtopk|radixSelect|bitonicSort", re.I)
# Within the MoE kernels, first match wins, else "expert GEMMs": alignment and token sorting (ours,
# vLLM's, FlashInfer's expert maps / prefix sums / row expansion), the experts' own kernels (GEMMs,
# activation, the weighted top-k sum, FlashInfer's finalize), then routing (softmax / sigmoid top-k,
# grouped top-k).
MOE_SUBCLASSES = (
    ("alignment", re.compile(r"align|count_and_sort|PrefixSum|BuildExpertMaps|expandInputRows|computeStrides", re.I)),
    ("expert GEMMs", re.compile(r"topk_sum|moe_sum|finalizeMoe|MoeFC|GroupProblemShape|fused_moe|moe_gemm|"
                                r"moe_decode|doActivation", re.I)),
    ("router top-k", re.compile(r"topk|gating|routing|fused_gate|softmax", re.I)),
)
# The other kernels, first match wins, else "other". Names of Inductor's fused kernels (triton_*) and
# of FlashAttention's (templated on cutlass types) mention GEMMs: they are matched before GEMMs.
OTHER_CLASSES = (
    ("attention", re.compile(r"flash|attn|attention|fmha|mla|reshape_and_cache|paged|slot_mapping|"
                             r"^reduce_segments$", re.I)),      # vLLM's Triton backend's split-softmax reduce
    ("norms/elementwise", re.compile(r"^triton_(poi|red|per)_", re.I)),
    ("dense GEMMs", re.compile(r"gemm|gemv|nvjet|cublas|splitKreduce|cutlass|xmma|^Kernel2$", re.I)),
    ("sampling", re.compile(r"sampl|argmax|softmax|distribution_|exponential|multinomial|TopKTopP|"
                            r"top_k_top_p|penalt|cumsum|sort", re.I)),
    ("norms/elementwise", re.compile(r"norm|elementwise|act_and_mul|silu|gelu|rotary|rope|quant|Fill|copy|"
                                     r"CatArray|gather|scatter|index|triton_", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
)
MOE_CLASSES = ("expert GEMMs", "router top-k", "alignment")
KERNEL_CLASSES = MOE_CLASSES + ("attention", "dense GEMMs", "norms/elementwise", "sampling",
                                "memcpy/memset", "other")


def kernel_class(name: str) -> str:
    """The one of KERNEL_CLASSES a GPU kernel (or memcpy/memset) of that name belongs to."""
    if MOE_KERNELS.search(name) and not SAMPLER_TOPK.search(name):
        return next((cls for cls, rx in MOE_SUBCLASSES if rx.search(name)), "expert GEMMs")
    if SAMPLER_TOPK.search(name):
        return "sampling"
    return next((cls for cls, rx in OTHER_CLASSES if rx.search(name)), "other")


def summarize_trace(path: Path, categories: tuple[str, ...] = GPU_CATEGORIES) -> dict[str, Any]:
    """{kernels: {name: [count, total us]}, busy_us, span_us} of one Chrome trace (.json[.gz]),
    over its complete events ("ph": "X") of the given categories, and cpu_ops: how many CPU op
    events it holds (what a CPU engine's trace shows)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans: list[tuple[float, float]] = []
    kernels: dict[str, list[float]] = {}
    cpu_ops = 0
    for e in events:
        cpu_ops += e.get("cat") == "cpu_op"
        if e.get("ph") == "X" and e.get("cat") in categories:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            spans.append((start, start + dur))
            k = kernels.setdefault(e["name"], [0, 0.0])
            k[0] += 1
            k[1] += dur
    busy, end = 0.0, float("-inf")
    for s, t in sorted(spans):                      # union of the intervals
        if t > end:
            busy += t - max(s, end)
            end = t
    span = max(t for _, t in spans) - min(s for s, _ in spans) if spans else 0.0
    return {"kernels": kernels, "busy_us": busy, "span_us": span, "cpu_ops": cpu_ops}


def class_us(summary: dict[str, Any]) -> dict[str, float]:
    """Kernel us per KERNEL_CLASSES entry in one trace summary."""
    out = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for name, (_, us) in summary["kernels"].items():
        out[kernel_class(name)] += us
    return out


def per_step_classes(profile: dict[str, Any], step_ms: float) -> dict[str, float]:
    """Per decode step (ms), long minus short as in per_step: each kernel class, GPU busy, and
    the measured step minus busy (GPU idle)."""
    (s, l), short, long_ = profile["tokens"], class_us(profile["short"]), class_us(profile["long"])
    out = {cls: (long_[cls] - short[cls]) / (l - s) / 1e3 for cls in KERNEL_CLASSES}
    out["busy_ms"] = (profile["long"]["busy_us"] - profile["short"]["busy_us"]) / (l - s) / 1e3
    out["gpu_idle_ms"] = step_ms - out["busy_ms"]
    return out


def overlap_ms(step: dict[str, float]) -> float:
    """Kernel ms of a per_step_classes step that ran beside other kernels: the classes' sum
    minus GPU busy (their union)."""
    return sum(step[cls] for cls in KERNEL_CLASSES) - step["busy_ms"]
