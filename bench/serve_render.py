"""Markdown of the yardstick (bench/serve_ab.py): the pooled A/B table and the per-step profile.

`results_table(*dirs)` is what RESULTS.md's generated block (bench/results_tables.py) and the top
of README.md show: for every model in the run directories, per concurrency and variant, ITL p50,
TTFT p50 and output tok/s (geometric means over processes), their ratios to vllm-serve with 95 %
intervals, % of the weight roofline, and how many processes; the API server process's CPU time per
output token where the processes recorded it; then where the decode step goes in every profiled
process.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # for bench/results_tables.py

from bench import decode_profile, serve_stats  # noqa: E402
from bench.serve_servers import ALL_VARIANTS, BASELINE  # noqa: E402

PRIMARY = {(1, "itl"), (32, "tok_s")}      # stated before any run: c=1 ITL p50, c=32 output tok/s
NOTE = ("Primary metrics, fixed before the runs: **c=1 ITL p50** and **c=32 output tok/s** (bold). "
        "A cell is the geometric mean over n processes (n server starts, variants in rotated order). "
        "Ratios to vllm-serve are oriented so that higher is better for the variant: ITL and TTFT "
        "speedup = vllm-serve's / the variant's, tok/s ratio = the variant's / vllm-serve's; each is the "
        "ratio of geometric means over processes with its 95 % Welch t interval on logs. % roofline = "
        "the weight-roofline step at c (weight bytes the step reads / the measured copy ceiling) / ITL p50.")


def _ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    ci = "n/a" if r["lo"] is None else f"{r['lo']:.3f}, {r['hi']:.3f}"
    return f"{r['ratio']:.3f} [{ci}]"


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _engine(w: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in w["engine"].items() if v is not None)


def ab_table(model: str, procs: list[serve_stats.Process]) -> list[str]:
    """One model's header lines and table."""
    w = procs[0].meta["workload"]
    runs = "; ".join(f"{host} ({gpu}) at {commit}: {n}" for host, gpu, commit, n in serve_stats.machines(procs))
    out = [f"**{model}**: prompt {w['prompt_tokens']} token ids, {w['output_tokens']} output tokens "
           f"(ignore_eos, temperature 0), streaming /v1/completions, closed loop at c = "
           f"{', '.join(map(str, w['levels']))}; engine: {_engine(w)}. Processes per machine and commit: {runs}.", "",
           "| model | c | variant | n | ITL p50 ms | ITL speedup [95 % CI] | TTFT p50 ms | TTFT speedup [95 % CI] "
           "| output tok/s | tok/s ratio [95 % CI] | % roofline |",
           "|---|---:|---|---:|---:|---|---:|---|---:|---|---:|"]
    coalesced = 0.0
    for r in serve_stats.pooled_rows(procs, BASELINE, ALL_VARIANTS):
        n = str(r["n"]) + (f" (+{r['failed']} failed)" if r["failed"] else "")
        if not r["n"]:
            out.append(f"| {model} | {r['level']} | {r['variant']} | {n} |" + " |" * 7)
            continue
        c, roof = r["level"], r["roofline_pct"]
        coalesced = max(coalesced, r["coalesced"])
        itl = _bold(f"{r['itl_p50_ms']:.3f}", (c, "itl") in PRIMARY)
        tok_s = _bold(f"{r['tok_s']:.1f}", (c, "tok_s") in PRIMARY)
        roof_text = "—" if roof is None else f"{roof:.0f} %"
        out.append(f"| {model} | {c} | {r['variant']} | {n} | {itl} | {_ratio(r.get('itl_speedup'))} | "
                   f"{r['ttft_p50_ms']:.1f} | {_ratio(r.get('ttft_speedup'))} | {tok_s} | "
                   f"{_ratio(r.get('tok_s_ratio'))} | {roof_text} |")
    if coalesced:
        out += ["", f"Some streams got several tokens in one chunk (up to {100 * coalesced:.0f} % of a cell's "
                    "requests): their ITL gaps are per chunk, not per token."]
    return out + api_cpu_table(model, procs)


def api_cpu_table(model: str, procs: list[serve_stats.Process]) -> list[str]:
    """What the HTTP side costs per token: the API process's CPU µs per output token per level and
    variant, where the processes recorded it (api_cpu.json); none: no lines."""
    rows = [r for r in serve_stats.pooled_rows(procs, BASELINE, ALL_VARIANTS) if "api_cpu_us_tok" in r]
    if not rows:
        return []
    out = ["", f"**{model}**, the API server process's CPU time per output token streamed (each timed level's "
               "warm-up and measured requests; the engine core and its workers are other processes). Ratio = "
               "vllm-serve's / the variant's: above 1, our HTTP side costs less CPU per token.", "",
           "| model | c | variant | n | API CPU µs / token | ratio [95 % CI] |", "|---|---:|---|---:|---:|---|"]
    for r in rows:
        out.append(f"| {model} | {r['level']} | {r['variant']} | {r['api_cpu_n']} | {r['api_cpu_us_tok']:.1f} | "
                   f"{_ratio(r.get('api_cpu_ratio'))} |")
    return out


def profile_table(procs: list[serve_stats.Process]) -> list[str]:
    """Per profiled process and level: the decode step split by kernel class (ms per step)."""
    cls = decode_profile.KERNEL_CLASSES
    out = ["| model | variant | round | c | step (ITL p50) | GPU busy | " + " | ".join(cls) + " | GPU idle |",
           "|---|---|---:|---:|" + "---:|" * (len(cls) + 3)]
    for p in sorted(procs, key=lambda p: (p.meta["workload"]["model"], p.variant, p.meta["round"])):
        for c, prof in sorted((p.meta.get("profile") or {}).get("levels", {}).items(), key=lambda kv: int(kv[0])):
            cell = p.cells.get(int(c), {})
            if cell.get("errors", 1):
                continue
            d = decode_profile.per_step_classes(prof, cell["itl_p50_ms"])
            out.append(f"| {p.meta['workload']['model']} | {p.variant} | {p.meta['round']} | {c} | "
                       f"{cell['itl_p50_ms']:.3f} | {d['busy_ms']:.3f} | "
                       + " | ".join(f"{d[k]:.3f}" for k in cls) + f" | {d['gpu_idle_ms']:.3f} |")
    return out if len(out) > 2 else []


def results_table(*dirs: Path) -> list[str]:
    """Every model's A/B table from the run directories, then the profile table if any process
    was profiled (ms per decode step: long minus short bursts, bench/serve_profile.py)."""
    procs = serve_stats.load(list(dirs))
    if not procs:
        raise FileNotFoundError(f"no complete yardstick process under {', '.join(map(str, dirs))}")
    out = [NOTE, ""]
    for model, ps in serve_stats.by_model(procs).items():
        out += ab_table(model, ps) + [""]
    prof = profile_table(procs)
    if prof:
        out += ["Where a decode step goes (ms per step; GPU idle = step - GPU busy; kernels that overlap "
                "count in each class):", ""] + prof + [""]
    return out[:-1]


def headline(*dirs: Path) -> list[str]:
    """One line per model and variant: the primary metrics against vllm-serve (c = 1 ITL p50
    speedup, c = 32 output tok/s ratio, 95 % intervals; **bold** where the lower bound is above 1)
    and the processes behind them."""
    out = []
    for model, procs in serve_stats.by_model(serve_stats.load(list(dirs))).items():
        rows = {(r["level"], r["variant"]): r for r in serve_stats.pooled_rows(procs, BASELINE, ALL_VARIANTS)}
        variants = [v for (_, v), r in rows.items() if v != BASELINE and r.get("itl_speedup")]
        for v in dict.fromkeys(variants):
            parts = []
            for c, key, what in ((1, "itl_speedup", "c = 1 ITL p50 speedup"), (32, "tok_s_ratio", "c = 32 output tok/s")):
                r, base = rows.get((c, v)), rows.get((c, BASELINE))
                if r and r.get(key) and base:
                    ratio = r[key]
                    parts.append(f"{what} " + _bold(_ratio(ratio), ratio["lo"] is not None and ratio["lo"] > 1)
                                 + f" ({r['n']} / {base['n']} processes)")
            out.append(f"- `{model}`, `{v}` vs `vllm serve`: " + "; ".join(parts) + ".")
    return out
