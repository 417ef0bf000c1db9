"""A profile of steady-state decode: GPU kernel time per decode step, and how much of it is MoE.

Used by `decode_probe.py --profile` after its timed measurement, in the same engine (built with
`engine_kwargs(dir)`): for each batch size B it records vLLM's torch profiler (CUPTI: kernels
replayed from CUDA graphs included) around one `--short` and one `--long` generate, and keeps a
summary of each trace: per kernel name the count and total us, the GPU busy time (union of all
kernel, memcpy and memset intervals) and the span from the first to the last. As with the step
time, long minus short over (long - short) tokens cancels prefill and per-request costs:

    per decode step: busy (ms), MoE kernels (ms, names matching MOE_KERNELS), the rest (ms)

and the measured step time minus busy is time the GPU waited (the CPU side of the step).
MoE and other are sums of kernel durations (kernels that overlap, as with PDL, count twice);
busy is the union. `kernel_class` sorts every kernel into one of KERNEL_CLASSES (the MoE kernels
into expert GEMMs, router top-k and alignment; the router's own GEMM is a dense cuBLAS GEMM that
its name does not tell apart, so it counts as a dense GEMM) and `per_step_classes` gives the
per-step time of each class the same way.

    python bench/decode_profile.py DIR [DIR...]     # markdown table of the profiled run files
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

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
    ("attention", re.compile(r"flash|attn|attention|fmha|mla|reshape_and_cache|paged|slot_mapping", re.I)),
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


def engine_kwargs(trace_dir: Path) -> dict[str, Any]:
    """vLLM engine arguments that enable its torch profiler (started only by start_profile)."""
    return {"profiler_config": {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()),
                                "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
                                "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}}


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


def record(llm: Any, trace_dir: Path, prefix: str, run: Callable[[], Any],
           keep: Path | None = None) -> dict[str, Any]:
    """Profile run() with the engine's profiler; the summary of the one trace it wrote. The
    trace is then deleted, or moved to keep/<prefix>.pt.trace.json.gz."""
    before = set(trace_dir.glob("*.pt.trace.json*"))
    llm.start_profile(prefix)
    try:
        run()
    finally:
        llm.stop_profile()
    new = sorted(set(trace_dir.glob("*.pt.trace.json*")) - before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new trace in {trace_dir}, found {[p.name for p in new]}")
    summary = summarize_trace(new[0])
    if keep is None:
        new[0].unlink()                               # traces are large; the summary is kept
    else:
        keep.mkdir(parents=True, exist_ok=True)
        gz = ".gz" if new[0].suffix == ".gz" else ""
        shutil.move(new[0], keep / f"{prefix}.pt.trace.json{gz}")
    return summary


def per_step(profile: dict[str, Any], step_ms: float) -> dict[str, float]:
    """Per decode step (ms) from one B's {"short": summary, "long": summary, "tokens": [s, l]}:
    GPU busy, MoE kernels, other kernels, and the measured step minus busy (GPU waiting)."""
    (s, l), short, long_ = profile["tokens"], profile["short"], profile["long"]

    def diff(f: Callable[[dict[str, Any]], float]) -> float:
        return (f(long_) - f(short)) / (l - s) / 1e3

    def moe_us(summary: dict[str, Any]) -> float:
        return sum(us for name, (_, us) in summary["kernels"].items() if kernel_class(name) in MOE_CLASSES)

    def all_us(summary: dict[str, Any]) -> float:
        return sum(us for _, us in summary["kernels"].values())

    busy, moe = diff(lambda x: x["busy_us"]), diff(moe_us)
    return {"busy_ms": busy, "moe_ms": moe, "other_ms": diff(all_us) - moe, "gpu_wait_ms": step_ms - busy}


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


def new_trace_dir() -> Path:
    """A fresh directory for the engine's traces (removed by the caller)."""
    return Path(tempfile.mkdtemp(prefix="decode-profile-"))


def table(runs: list[dict[str, Any]]) -> list[str]:
    """Markdown rows per profiled run and B: the measured step and its per-step profile (ms), and
    the MoE kernels' share of the measured step."""
    out = ["| variant | round | B | step | GPU busy | MoE kernels | other kernels | GPU waiting | MoE share of step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted((r for r in runs if r.get("profile")), key=lambda r: (r["variant"], r["round"])):
        for row in r["rows"]:
            p = r["profile"].get(str(row["B"]))
            if p:
                d = per_step(p, row["step_ms"])
                out.append(f"| {r['variant']} | {r['round']} | {row['B']} | {row['step_ms']:.3f} | "
                           f"{d['busy_ms']:.3f} | {d['moe_ms']:.3f} | {d['other_ms']:.3f} | "
                           f"{d['gpu_wait_ms']:.3f} | {100 * d['moe_ms'] / row['step_ms']:.0f} % |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    a = ap.parse_args(argv)
    from decode_stats import load_runs          # the run files as the A/B statistics read them

    print("\n".join(table(load_runs(a.dirs))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
