"""The generated blocks of RESULTS.md, HISTORY.md and the README's headline, recomputed from the
raw files under bench/results/ (plain files, or a closed date's archive: bench/results_archive.py).

Each generated block sits between two marker lines::

    <!-- results_tables: NAME -->
    ...generated, do not edit...
    <!-- /results_tables -->

and REGISTRY maps NAME to its raw files and the function that renders them (results_render*.py).
A new section: put its raw files under bench/results/<date>/, add a render function and one
REGISTRY entry, and put the two marker lines where the table goes.

    python bench/results_tables.py            # rewrite every block of the documents from the raw files
    python bench/results_tables.py --check    # exit 1 with a diff when a document differs (CI)
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Union

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import results_render as rr  # noqa: E402
import results_render_fp8 as rf  # noqa: E402
import results_render_kernels as rk  # noqa: E402
import results_render_now as rn  # noqa: E402
import serve_render as sr  # noqa: E402
from results_archive import raw  # noqa: E402

DOCS = (BENCH / "RESULTS.md", BENCH / "HISTORY.md", BENCH.parent / "README.md")
BLOCK = re.compile(r"(<!-- results_tables: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results_tables -->)", re.S)
Raw = Union[str, tuple["Raw", ...]]


def _resolve(r: Raw):
    """A raw path relative to bench/results/ (or a nested tuple of them) -> readable path(s)."""
    return raw(r) if isinstance(r, str) else tuple(_resolve(x) for x in r)


def _flat(r: Raw) -> list[str]:
    return [r] if isinstance(r, str) else [p for x in r for p in _flat(x)]


@dataclass(frozen=True)
class Entry:
    """One generated block: render(*args, *raw paths) -> markdown lines (args first). A raw item
    may be a tuple of paths; the renderer then gets a tuple."""

    raw: tuple[Raw, ...]                 # paths relative to bench/results/
    render: Callable[..., list[str]]
    args: tuple = ()

    def lines(self) -> list[str]:
        missing = [p for p in _flat(self.raw) if not raw(p).exists()]
        if missing:
            raise FileNotFoundError(f"raw files missing under {BENCH / 'results'}: {missing}")
        return self.render(*self.args, *_resolve(self.raw))


D = "2026-11-29/"
E2E_RUNS = (D + "e2e_ab_run1_committed_routing", D + "e2e_ab_run2_tuned_reversed")
FRONT5 = D + "frontend/run5_pinned_gc_frozen/"
K1 = "2026-12-01/"
B1 = K1 + "kernels_session_b/bench_results.json"
B2 = (K1 + "kernels_validation/tuned_fine_m.json", K1 + "kernels_validation/untuned.json")
F8 = K1 + "fp8_session/"
T3 = K1 + "tune_ab_session/"
S4 = K1 + "bf16_ab_session/"
S5 = K1 + "fp8_spread_session/decode_ab_fp8_spread"
S6 = "2026-12-02/fp8_spread_session6/"
S6AB = S6 + "decode_ab_fp8_spread"
S6BF = "2026-12-02/bf16_spread_session6/decode_ab_bf16_spread"
S9 = "2026-12-02/session9_serve_ab/"
S11 = "2026-12-03/session11/"
S12 = "2026-12-03/session12/"
S13 = "2026-12-03/session13/"
S14 = "2026-12-04/session14/"
S15 = "2026-12-04/session15/"
S16 = "2026-12-04/session16/"
S17 = "2026-12-04/session17/"
S18 = "2026-12-05/session18/cpu_frontend/"
S17_REFINED = tuple(S17 + "refine/" + f for f in (
    "E=128,N=768,K=2048,dtype=bf16,device=NVIDIA_H200.json",
    "E=128,N=768,K=2048,dtype=fp8_w8a8,block_shape=[128,128],device=NVIDIA_H200.json",
    "E=256,N=256,K=7168,dtype=fp8_w8a8,block_shape=[128,128],device=NVIDIA_H200.json",
    "E=128,N=192,K=4096,dtype=fp8_w8a8,block_shape=[128,128],device=NVIDIA_H200.json",
    "E=8,N=14336,K=4096,dtype=bf16,device=NVIDIA_H200.json"))
FP8_BLOCK_SERVE = (S14 + "serve_ab/qwen3-30b-a3b-fp8-block", S15 + "serve_ab/qwen3-30b-a3b-fp8-block")
FP8_DYNAMIC_SERVE = (S13 + "serve_ab/qwen3-30b-a3b-fp8-dynamic", S13 + "serve_ab/qwen3-30b-a3b-fp8-dynamic-r2")
NOW_SERVE = (S9 + "qwen3-30b-a3b", S11 + "serve_ab/qwen3-30b-a3b", S16 + "serve_ab/qwen3-30b-a3b",  # the whole-
             S9 + "mixtral-8x7b", S11 + "serve_ab/mixtral-8x7b",                                  # model
             S11 + "serve_ab/mixtral-8x7b-round2")                                                # yardstick
NOW_FP8 = (S5, S6AB)                       # the newest runs behind the current answer
NOW_BF16 = (S4 + "decode_ab_bf16",)
NOW_KERNELS = (*B2, T3 + "validation.json")   # later files replace earlier ones per shape
NOW_TUNE = (K1 + "kernels_session_b/tune_bf16.log", K1 + "kernels_session_b/tune_fp8.log", T3 + "tune.log")
REGISTRY: dict[str, Entry] = {
    "serve-ab-cpu-embedded": Entry(("2026-12-02/serve_ab_cpu_embedded",), sr.results_table),
    "serve-ab": Entry(NOW_SERVE, sr.results_table),
    "serve-ab-headline": Entry(NOW_SERVE, sr.headline),
    "serve-ab-session7": Entry(("2026-12-02/session7_serve_ab",), sr.results_table),
    "serve-ab-cpu-frontend": Entry((S16 + "cpu_frontend/embedded",), sr.results_table),
    "router-kernel": Entry(("2026-12-02/session9_router/router.json",), rn.router_table),
    "moe-block": Entry((S11 + "moe_block.json",), rn.moe_block_table),
    "attention": Entry((S12 + "attention.json",), rn.attention_table),
    "serve-ab-fp8-block": Entry(FP8_BLOCK_SERVE, sr.results_table),
    "serve-ab-fp8-block-headline": Entry(FP8_BLOCK_SERVE, sr.headline),
    "serve-ab-fp8-block-session12": Entry((S12 + "serve_ab/qwen3-30b-a3b-fp8-block",), sr.results_table),
    "gemv": Entry((S14 + "gemv/gemv.json",), rk.gemv_table),
    "prefetch": Entry((S17 + "prefetch/prefetch.json",), rk.prefetch_table),
    "prefetch-refined": Entry(S17_REFINED, rk.refined_tables),
    "serve-ab-session17": Entry((S17 + "serve_ab/qwen3-30b-a3b",), sr.results_table),
    "serve-ab-cpu-frontend-after": Entry((S17 + "cpu_frontend_after/run2",), sr.results_table),
    "serve-ab-cpu-frontend-after-loaded": Entry((S17 + "cpu_frontend_after/run1",), sr.results_table),
    "serve-ab-cpu-frontend-s18-before": Entry((S18 + "before",), sr.results_table),
    "serve-ab-cpu-frontend-s18-accepted": Entry((S18 + "accepted",), sr.results_table),
    "serve-ab-cpu-frontend-s18-final": Entry((S18 + "final",), sr.results_table),
    "serve-ab-fp8-dynamic": Entry(FP8_DYNAMIC_SERVE, sr.results_table),
    "serve-ab-fp8-dynamic-headline": Entry(FP8_DYNAMIC_SERVE, sr.headline),
    "tune-fp8-dynamic": Entry((S13 + "tune_fp8dyn/routing,device=NVIDIA_H200.json",), rf.tune_routing_points,
                              ("E=128,N=768,K=2048,dtype=fp8_w8a8,per_token",)),
    "fp8-aligned": Entry((S15 + "aligned/results.json",), partial(rf.fp8_aligned, served_candidate="swap")),
    "fp8-aligned-session13": Entry((S13 + "kern/results.json",), rf.fp8_aligned),
    "format-bench-fp8": Entry((S15 + "fmt/results.json",), rf.format_bench),
    "readme-headline": Entry((NOW_FP8, NOW_BF16, *NOW_KERNELS), rn.headline),
    "now-decode-ab": Entry((NOW_FP8, NOW_FP8, NOW_BF16), rn.decode_ab_summary,
                           ((("moe-serve", "stock"), ("moe-serve", "vllm-triton"), ("moe-serve", "stock")),)),
    "now-kernels": Entry(NOW_KERNELS, rn.kernel_shapes),
    "now-tune-times": Entry(NOW_TUNE, rn.tune_times_now),
    "decode-ab-fp8-spread-5": Entry((S5, S6AB), rf.decode_ab, ("stock",)),
    "decode-ab-fp8-spread-5-vs-triton": Entry((S5, S6AB), rf.decode_ab, ("vllm-triton",)),
    "fp8-backends-l2cold": Entry((S6 + "fp8b_l2cold.json",), rf.fp8_backends_l2),
    "moe-share-fp8-spread-5": Entry((S6 + "fp8b_l2cold.json", S5, S6AB), rf.moe_share, ("Mixtral-8x7B/TP8", "fp8", 32)),
    "moe-share-fp8-spread-5-l2cold": Entry((S6 + "fp8b_l2cold.json", S5, S6AB),
                                           partial(rf.moe_share, timing="_l2cold_us"), ("Mixtral-8x7B/TP8", "fp8", 32)),
    "decode-profile-fp8-spread": Entry((S6AB,), rf.decode_profile_table),
    "decode-profile-bf16-spread": Entry((S6BF,), rf.decode_profile_table),
    "moe-bound-bf16-spread": Entry((B2[0], S6BF), rf.moe_bound, ("Mixtral-8x7B/TP8", "bf16")),
    "process-times-session6": Entry((S6AB, S6BF), rf.process_times),
    "decode-ab-fp8-spread": Entry((S5,), rf.decode_ab, ("stock",)),
    "decode-ab-fp8-spread-vs-triton": Entry((S5,), rf.decode_ab, ("vllm-triton",)),
    "moe-share-fp8-spread": Entry((F8 + "fp8_backends.json", S5), rf.moe_share, ("Mixtral-8x7B/TP8", "fp8", 32)),
    "process-times-fp8-spread": Entry((S5,), rf.process_times),
    "decode-ab-bf16-6": Entry((S4 + "decode_ab_bf16",), rf.decode_ab, ("stock",)),
    "moe-share-bf16-6": Entry((B2[0], S4 + "decode_ab_bf16"), rf.moe_share, ("Mixtral-8x7B/TP8", "bf16", 32)),
    "ttft-spike-pooled": Entry(E2E_RUNS + (D + "e2e_tp2_a", D + "e2e_tp2_b"), rr.e2e_ttft_pooled, ("spike-sizes",)),
    "fp8-prequant-grid": Entry((S4 + "fp8_large_n_prequant.json", T3 + "validation.json"), rk.prequant_grid,
                               ("Mixtral-8x7B/TP2", "fp8")),
    "tune-times-tp2-tp1-seeded": Entry((T3 + "tune.log",), rk.tune_times),
    "kernels-tp2-tp1-geomeans": Entry((T3 + "validation.json",), rk.geomeans),
    "kernels-tp2-tp1-served": Entry((T3 + "validation.json",), rk.served_below),
    "fp8-backends-tp2-tp1": Entry((T3 + "fp8_backends_tp2_tp1.json",), rf.fp8_backends),
    "decode-ab-fp8-6": Entry((F8 + "decode_ab_fp8", T3 + "decode_ab_fp8"), rf.decode_ab, ("stock",)),
    "moe-share-fp8-6": Entry((F8 + "fp8_backends.json", F8 + "decode_ab_fp8", T3 + "decode_ab_fp8"),
                             rf.moe_share, ("Mixtral-8x7B/TP8", "fp8", 32)),
    "fp8-backends": Entry((F8 + "fp8_backends.json",), rf.fp8_backends),
    "decode-ab-fp8": Entry((F8 + "decode_ab_fp8",), rf.decode_ab, ("stock",)),
    "moe-share-fp8": Entry((F8 + "fp8_backends.json", F8 + "decode_ab_fp8"), rf.moe_share,
                           ("Mixtral-8x7B/TP8", "fp8", 32)),
    "tune-phases-tp2-tp1": Entry((F8 + "tune.log",), rf.tune_phases),
    "kernels-correctness-fp8-session": Entry((F8 + "correctness.json",), rk.correctness),
    "decode-sweep": Entry((K1 + "decode_sweep/decode_sweep.json",), rk.decode_sweep),
    "decode-correctness-747e918": Entry((K1 + "decode_sweep/correctness.json",), rk.correctness),
    "kernels-correctness-final": Entry((K1 + "kernels_validation/correctness.json",), rk.correctness),
    "tune-times": Entry((K1 + "kernels_session_b/tune_bf16.log", K1 + "kernels_session_b/tune_fp8.log"),
                        rk.tune_times),
    "kernels-b1-geomeans": Entry((B1,), rk.geomeans),
    "kernels-b1-served": Entry((B1,), rk.served_below),
    "kernels-b2-geomeans": Entry(B2, rk.geomeans),
    "kernels-b2-served": Entry(B2, rk.served_below),
    "kernels-b2-floor-tuned": Entry(B2[:1], rk.floor_table),
    "kernels-b2-floor-untuned": Entry(B2[1:], rk.floor_table),
    "kernels-quick-bench": Entry((D + "kernels_quick_bench.json",), rr.kernel_bench, ("bench",)),
    "kernels-quick-bench-compiles": Entry((D + "kernels_quick_bench.json",), rr.kernel_compiles),
    "kernels-untuned": Entry((D + "kernels_untuned.json",), rr.kernel_bench, ("untuned",)),
    "plugin-check": Entry((D + "plugin_check.json",), rr.plugin_check),
    "kernels-tuned": Entry((D + "kernels_quick_bench_tuned.json", D + "kernels_quick_bench.json"),
                           rr.kernel_bench_tuned),
    "e2e-spike-stages": Entry(E2E_RUNS, rr.e2e_stages, ("spike-sizes",)),
    "e2e-spike-all": Entry(E2E_RUNS, rr.e2e_all_requests, ("spike-sizes",)),
    "e2e-step-stages": Entry(E2E_RUNS, rr.e2e_stages, ("step",)),
    "e2e-step-all": Entry(E2E_RUNS, rr.e2e_all_requests, ("step",)),
    "cpu-starvation": Entry((D + "cpu_starvation/starvation.json",), rr.cpu_starvation),
    "gc-freeze": Entry(tuple(D + "gc_freeze/" + f for f in ("step_before_freeze.md", "step_after_freeze.md",
                                                             "gc_pauses_before.txt", "gc_pauses_after.txt")),
                       rr.gc_freeze),
    "frontend-run5": Entry((FRONT5 + "summary.md", *(FRONT5 + f"rep{i}.md" for i in range(4))), rr.frontend),
    "idle-probe": Entry((D + "idle_probe/idle.json",), rr.idle_probe),
    "soak-run1": Entry((D + "soak/soak.json",), rr.soak),
    "soak-run2": Entry((D + "soak_run2_locust_pinned/soak.json",), rr.soak),
    "soak-run3-curve": Entry((D + "soak_run3_malloc_trim/rss.csv", D + "soak_run3_malloc_trim/soak.json"),
                             rr.soak_curve),
    "soak-run6-curve": Entry((D + "soak_run6_bpe_cache_bounded_30min/rss.csv",
                              D + "soak_run6_bpe_cache_bounded_30min/soak.json"), rr.soak_curve),
}


def _names(texts: dict[Path, str]) -> set[str]:
    """The block names the documents hold; raises on a name REGISTRY does not know or on a
    REGISTRY entry no document holds (before any rendering)."""
    names = {m["name"] for text in texts.values() for m in BLOCK.finditer(text)}
    unknown = names - set(REGISTRY)
    if unknown:
        raise KeyError(f"blocks {sorted(unknown)} are not in REGISTRY")
    unused = set(REGISTRY) - names
    if unused:
        raise KeyError(f"REGISTRY entries without a block in {', '.join(p.name for p in texts)}: {sorted(unused)}")
    return names


def render(texts: dict[Path, str]) -> dict[Path, str]:
    """Every document with every block regenerated from its raw files."""
    _names(texts)

    def block(m: re.Match) -> str:
        return m.group(1) + "\n".join(REGISTRY[m["name"]].lines()) + "\n" + m.group(4)

    return {path: BLOCK.sub(block, text) for path, text in texts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a document differs")
    p.add_argument("docs", nargs="*", type=Path, default=list(DOCS),
                   help="the documents holding every block (default: RESULTS.md, HISTORY.md, README.md)")
    a = p.parse_args(argv)
    old = {d: d.read_text() for d in a.docs}
    new = render(old)
    changed = [d for d in a.docs if new[d] != old[d]]
    if a.check:
        for d in changed:
            sys.stdout.writelines(difflib.unified_diff(old[d].splitlines(True), new[d].splitlines(True),
                                                       str(d), "regenerated from bench/results/"))
            print(f"\n{d} differs from its raw files: run python bench/results_tables.py", file=sys.stderr)
        if changed:
            return 1
        print(f"{', '.join(d.name for d in a.docs)}: {len(REGISTRY)} blocks match their raw files")
        return 0
    for d in changed:
        d.write_text(new[d])
    print(f"{', '.join(d.name for d in a.docs)}: {len(REGISTRY)} blocks written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
