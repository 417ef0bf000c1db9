"""Markdown of the yardstick: the pooled A/B table, the answers, the step profile, the headline.

`results_table(*dirs)` renders every model in the run directories (ab_tables.py: per concurrency
and variant ITL p50, TTFT p50 and output tok/s, their ratios to vllm-serve with 95 % intervals, the
baseline's MoE table, flagged processes, API CPU, answers), then where the decode step goes in
every profiled process. `headline(rows)` is the first-screen table of RESULTS.md and README.md:
one row per model, format and GPU, the primary metrics of the two expert-load modes (headline.py).
"""
from __future__ import annotations

from pathlib import Path

from moe_serve.bench.model_dirs import model_config_of_run
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve import roofline, trace
from moe_serve.bench.serve.ab_tables import ab_table, ratio_text
from moe_serve.bench.serve.headline import HeadlineRow, model_format, row_data
from moe_serve.bench.serve.servers import BASELINE

NOTE = ("Primary metrics, fixed before the runs: **c = 1 ITL p50** (as the weights route) and **c = 8 output "
        "tok/s** (under uniform expert load) (bold). A cell is the geometric mean over n processes (n server "
        "starts, variants in rotated order). Ratios to vllm-serve are oriented so that higher is better for the "
        "variant: ITL and TTFT speedup = vllm-serve's / the variant's, tok/s ratio = the variant's / "
        "vllm-serve's; each is the ratio of geometric means over processes with its 95 % Welch t interval on "
        "logs. % floor = the step at the byte floor (weights read, experts hit under uniform routing, KV cache, "
        "over the measured copy ceiling) / ITL p50.")



def profile_table(procs: list[serve_stats.Process]) -> list[str]:
    """Per profiled process and level: the decode step split by kernel class (ms per step)."""
    cls = trace.KERNEL_CLASSES
    out = ["| model | variant | round | c | step (ITL p50) | GPU busy | " + " | ".join(cls) + " | GPU idle |",
           "|---|---|---:|---:|" + "---:|" * (len(cls) + 3)]
    for p in sorted(procs, key=lambda p: (p.meta["workload"]["model"], p.variant, p.meta["round"])):
        for c, prof in sorted((p.meta.get("profile") or {}).get("levels", {}).items(), key=lambda kv: int(kv[0])):
            cell = p.cells.get(int(c), {})
            if cell.get("errors", 1):
                continue
            d = trace.per_step_classes(prof, cell["itl_p50_ms"])
            out.append(f"| {p.meta['workload']['model']} | {p.variant} | {p.meta['round']} | {c} | "
                       f"{cell['itl_p50_ms']:.3f} | {d['busy_ms']:.3f} | "
                       + " | ".join(f"{d[k]:.3f}" for k in cls) + f" | {d['gpu_idle_ms']:.3f} |")
    return out if len(out) > 2 else []


def results_table(*dirs: Path, note: bool = True) -> list[str]:
    """Every model's A/B table from the run directories (after NOTE, the method, unless `note` is
    False), then the profile table if any process was profiled (ms per decode step: long minus
    short bursts, profile.py)."""
    procs = serve_stats.load(list(dirs))
    if not procs:
        raise FileNotFoundError(f"no complete yardstick process under {', '.join(map(str, dirs))}")
    out = [NOTE, ""] if note else []
    for ps in serve_stats.by_model(procs, BASELINE).values():
        out += ab_table(ps[0].meta["workload"]["model"], ps) + [""]
    prof = profile_table(procs)
    if prof:
        out += ["Where a decode step goes (ms per step; GPU idle = step - GPU busy; kernels that overlap "
                "count in each class):", ""] + prof + [""]
    return out[:-1]


# The step's slices: the profile's kernel classes each belongs to, and the byte-floor parts it must read.
SLICES = (("experts", ("expert GEMMs", "alignment"), ("experts", "shared_experts")),
          ("router", ("router top-k",), ("router",)),
          ("attention (KV cache)", ("attention",), ("kv_cache",)),
          ("dense GEMMs", ("dense GEMMs",), ("attention", "dense_mlp", "lm_head")),
          ("norms, rope, elementwise", ("norms/elementwise",), ("norms", "embedding_rows")),
          ("sampling, copies, other", ("sampling", "memcpy/memset", "other"), ()))


def pairwise_table(*dirs: Path, pairs: tuple[tuple[str, str], ...]) -> list[str]:
    """One switch's effect: per (variant, reference) pair and c, the variant against the reference
    variant of the same runs (not against vllm serve): ITL speedup = the reference's / the
    variant's, tok/s ratio = the variant's / the reference's, 95 % intervals over processes."""
    procs = serve_stats.load(list(dirs))
    out = ["| c | variant | against | processes | ITL speedup [95 % CI] | tok/s ratio [95 % CI] |",
           "|---:|---|---|---|---|---|"]
    for variant, reference in pairs:
        for r in serve_stats.pooled_rows(procs, reference, (reference, variant)):
            if r["variant"] == variant and "itl_speedup" in r:
                n_ref = r["itl_speedup"]["n_base"]
                out.append(f"| {r['level']} | {variant} | {reference} | {r['n']} + {n_ref} | "
                           f"{ratio_text(r['itl_speedup'])} | {ratio_text(r['tok_s_ratio'])} |")
    return out


def step_budget(*dirs: Path) -> list[str]:
    """Per profiled process and level, one row: the decode step and each of its SLICES as
    measured ms (from the profile) and, in parentheses, the slice's floor (its bytes over the run's
    copy ceiling; none under a µs: '-'), then the overlap (kernel time that ran beside other
    kernels, as PDL lets a kernel start before the previous one ends: each class counts it) and
    GPU idle, so that the slices minus the overlap plus GPU idle make the step."""
    out = ["| model | variant | commit | c | step ms (floor) | " + " | ".join(n for n, _, _ in SLICES)
           + " | overlap | GPU idle |",
           "|---|---|---|---:|---:|" + "---:|" * (len(SLICES) + 2)]
    for p in sorted(serve_stats.load(list(dirs)), key=lambda p: (p.meta["workload"]["model"], p.variant)):
        w, ceiling = p.meta["workload"], p.meta.get("copy_ceiling_bps")
        cfg = model_config_of_run(w["model"], w["config_sha256"])
        for c, prof in sorted((p.meta.get("profile") or {}).get("levels", {}).items(), key=lambda kv: int(kv[0])):
            cell = p.cells.get(int(c), {})
            if cell.get("errors", 1) or not ceiling or cfg is None:
                continue
            d = trace.per_step_classes(prof, cell["itl_p50_ms"])
            parts = roofline.byte_floor(cfg, w["engine"]["tensor_parallel_size"], int(c),
                                        w["prompt_tokens"] + w["output_tokens"] / 2)

            def cell_text(ms: float, floor_parts: tuple[str, ...]) -> str:
                floor = sum(parts[k] for k in floor_parts) / ceiling * 1e3
                return f"{ms:.3f} ({floor:.3f})" if floor >= 1e-3 else f"{ms:.3f} (-)"

            slices = [cell_text(sum(d[k] for k in classes), floor_parts) for _, classes, floor_parts in SLICES]
            out.append(f"| {w['model']} | {p.variant} | {(p.meta.get('commit') or '?')[:7]} | {c} | "
                       f"{cell_text(cell['itl_p50_ms'], ('total',))} | " + " | ".join(slices)
                       + f" | {trace.overlap_ms(d):.3f} | {d['gpu_idle_ms']:.3f} |")
    return out


def headline(rows: list[HeadlineRow]) -> list[str]:
    """The first-screen table: per model, format and GPU, the MoE table `vllm serve` ran, then
    moe-serve against it at c = 1 (ITL p50 speedup, as the weights route) and c = 8 and 64
    (output tok/s ratio, uniform expert load), with 95 % intervals (**bold**: lower bound above 1)
    and processes (ours + vllm serve's), or n/a below the bar (headline.py); % of the byte floor at
    c = 1 and c = 64, the commits, and the settings measured with the share of MoE launches our
    kernel ran as the weights route."""
    out = ["| model | format | GPU, TP | `vllm serve` MoE table | c = 1 ITL speedup (weights' routing) "
           "| c = 8 tok/s (uniform load) | c = 64 tok/s (uniform load) | % floor c = 1 / 64 | commits | settings |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for h in rows:
        d = row_data(h)
        floors = " / ".join("—" if not x.row or x.row.get("floor_pct") is None else f"{x.row['floor_pct']:.0f} %"
                            for x in (d.c1, d.c64))
        gpu = d.gpu + (f", TP {d.tp}" if d.tp else "")
        settings = "; ".join(x for x in (h.settings, d.launches) if x) + (
            f"; to measure: `{h.command}`" if h.command and not d.measured else "")
        out.append(f"| {h.model} | {model_format(h.model)} | {gpu} | {d.baseline} | {d.c1.text} | {d.c8.text} | "
                   f"{d.c64.text} | {floors} | {', '.join(d.commits) or '—'} | {settings} |")
    return out
