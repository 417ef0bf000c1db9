"""Markdown of one model's yardstick processes: the A/B table, the API CPU and answers tables.

`ab_table(model, procs)` renders per concurrency and variant ITL p50, TTFT p50 and output tok/s
(geometric means over processes), their ratios to vllm-serve with 95 % intervals, % of the byte
floor and how many processes; under it, the `vllm serve` MoE table the processes ran
(baseline_table.row_label), the processes outside their variant's spread with the ratios with
and without them (spread.py), then the API server process's CPU time per output token where
recorded and the answers against vllm-serve's.
"""
from __future__ import annotations

from typing import Any

from moe_serve.bench.serve import baseline_table, spread
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve.servers import ALL_VARIANTS, BASELINE, WEIGHTS

PRIMARY = {(1, "itl"), (8, "tok_s")}      # stated before any run: c = 1 ITL p50, c = 8 output tok/s
def ratio_text(r: dict[str, Any] | None) -> str:
    """"1.150 [1.136, 1.163]" (ratio [95 % interval]); "[n/a]" without an interval; "—" for none."""
    if r is None:
        return "—"
    ci = "n/a" if r["lo"] is None else f"{r['lo']:.3f}, {r['hi']:.3f}"
    return f"{r['ratio']:.3f} [{ci}]"


def bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _engine(w: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in w["engine"].items() if v is not None and k != "routing")


def routing_of(w: dict[str, Any]) -> str:
    """The run's expert-load mode (runs before the mode existed routed as the weights do)."""
    return w["engine"].get("routing", WEIGHTS)


def _runs(procs: list[serve_stats.Process]) -> str:
    return "; ".join(f"{host} ({gpu}) at {commit}: {n}" for host, gpu, commit, n in serve_stats.machines(procs))


def _backends(procs: list[serve_stats.Process]) -> str:
    """" `vllm serve` chose: MoE backend X, attention Y, sampler Z; FlashInfer not installed." from
    the baseline's processes where they recorded it (each distinct choice, joined by " / "); "" else."""
    base = [p.meta for p in procs if p.variant == BASELINE and "backends" in p.meta]
    if not base:
        return ""
    said = []
    for key, name in (("moe", "MoE backend"), ("attention", "attention"), ("sampler", "sampler")):
        seen = sorted({m["backends"][key] for m in base if key in m["backends"]})
        if seen:
            said.append(f"{name} {' / '.join(seen)}")
    fi = sorted({m.get("flashinfer") or "not installed" for m in base})
    return f" `vllm serve` chose: {', '.join(said)}; FlashInfer {' / '.join(fi)}."


def ab_table(model: str, procs: list[serve_stats.Process]) -> list[str]:
    """One model's header lines and table."""
    w = procs[0].meta["workload"]
    out = [f"**{model}**, expert load `{routing_of(w)}`: prompt {w['prompt_tokens']} token ids, {w['output_tokens']} "
           f"output tokens (ignore_eos, temperature 0), streaming /v1/completions, closed loop at c = "
           f"{', '.join(map(str, w['levels']))}; engine: {_engine(w)}. Processes per machine and commit: "
           f"{_runs(procs)}.{_backends(procs)}", "",
           "| model | c | variant | n | ITL p50 ms | ITL speedup [95 % CI] | TTFT p50 ms | TTFT speedup [95 % CI] "
           "| output tok/s | tok/s ratio [95 % CI] | % floor |",
           "|---|---:|---|---:|---:|---|---:|---|---:|---|---:|"]
    coalesced = 0.0
    for r in serve_stats.pooled_rows(procs, BASELINE, ALL_VARIANTS):
        n = str(r["n"]) + (f" (+{r['failed']} failed)" if r["failed"] else "")
        if not r["n"]:
            out.append(f"| {model} | {r['level']} | {r['variant']} | {n} |" + " |" * 7)
            continue
        c, floor = r["level"], r["floor_pct"]
        coalesced = max(coalesced, r["coalesced"])
        itl = bold(f"{r['itl_p50_ms']:.3f}", (c, "itl") in PRIMARY)
        tok_s = bold(f"{r['tok_s']:.1f}", (c, "tok_s") in PRIMARY)
        floor_text = "—" if floor is None else f"{floor:.0f} %"
        out.append(f"| {model} | {c} | {r['variant']} | {n} | {itl} | {ratio_text(r.get('itl_speedup'))} | "
                   f"{r['ttft_p50_ms']:.1f} | {ratio_text(r.get('ttft_speedup'))} | {tok_s} | "
                   f"{ratio_text(r.get('tok_s_ratio'))} | {floor_text} |")
    if coalesced:
        out += ["", f"Some streams got several tokens in one chunk (up to {100 * coalesced:.0f} % of a cell's "
                    "requests): their ITL gaps are per chunk, not per token."]
    return out + baseline_lines(procs) + flag_lines(procs) + api_cpu_table(model, procs) + answers_table(model, procs)


def counts(ratio: dict[str, Any]) -> str:
    """"3 + 3": the processes behind a ratio, the variant's + the baseline's."""
    return f"{ratio['n']} + {ratio['n_base']}"


def baseline_lines(procs: list[serve_stats.Process], fallback: str = "not recorded") -> list[str]:
    """The `vllm serve` MoE table these processes ran (baseline_table.row_label), and a warning
    where any ran from a tree with uncommitted changes."""
    base = [(p.dir, p.meta) for p in procs if p.variant == BASELINE]
    out = ["", f"`vllm serve`'s MoE table: {baseline_table.row_label(base, fallback)}."] if base else []
    dirty = [p for p in procs if p.meta.get("dirty")]
    if dirty:
        out += ["", f"**Not publishable**: {len(dirty)} of {len(procs)} processes ran from a tree with uncommitted "
                    "changes (`+dirty`)."]
    return out


def flag_lines(procs: list[serve_stats.Process]) -> list[str]:
    """The processes outside their variant's spread (spread.py), each with the ratios it enters,
    with and without it; none flagged: no lines."""
    found = spread.flags(procs)
    if not found:
        return []
    out = ["", "Processes outside their variant's spread (farther from the nearest other process than twice the "
               "others' range and 2 %), and the ratios with and without them:", ""]
    for f in found:
        value = (f"ITL p50 {f.value:.3f} ms (the others {f.others[0]:.3f}-{f.others[1]:.3f})" if f.metric == "itl_p50_ms"
                 else f"output tok/s {f.value:.1f} (the others {f.others[0]:.1f}-{f.others[1]:.1f})")
        ratios = "; ".join(f"{v} {ratio_text(w)} ({counts(w)}) with it, "
                           + (f"{ratio_text(wo)} ({counts(wo)}) without" if wo else "no ratio without")
                           for v, w, wo in spread.with_and_without(procs, f, BASELINE, ALL_VARIANTS))
        out.append(f"- c = {f.level}, {f.variant} r{f.round}: {value}{': ' + ratios if ratios else ''}")
    return out


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
                   f"{ratio_text(r.get('api_cpu_ratio'))} |")
    return out


def answers_table(model: str, procs: list[serve_stats.Process]) -> list[str]:
    """Each variant's answers against vllm-serve's first process (the other vllm-serve processes:
    the noise floor); none recorded: no lines."""
    rows = serve_stats.answer_rows(procs, BASELINE)
    if not rows:
        return []
    out = ["", f"**{model}**, same answers: teacher-forced log-probabilities of fixed prompts (bench/serve/answers.py) "
               f"against {BASELINE}'s first process; {BASELINE}'s own other processes are the noise floor.", "",
           "| model | variant | processes | positions each | top-1 agreement (lowest) | max abs logprob diff |",
           "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {model} | {r['variant']} | {r['n']} | {r['positions']} | {r['top1_agreement']:.4f} | "
                   f"{r['max_logprob_diff']:.4f} |")
    return out




def summary_lines(procs: list[serve_stats.Process], variant: str) -> list[str]:
    """One line per expert-load mode: the variant's ITL speedup and tok/s ratio against vllm-serve
    at every level with intervals and processes, and the timed requests per process; the numbers a
    section's prose would otherwise repeat by hand."""
    out = []
    for ps in serve_stats.by_model(procs, BASELINE).values():
        rows = [r for r in serve_stats.pooled_rows(ps, BASELINE, ALL_VARIANTS) if r["variant"] == variant]
        parts = [f"{name} " + ", ".join(f"c = {r['level']} {ratio_text(r[key])} ({counts(r[key])})"
                                        for r in rows if key in r)
                 for key, name in (("itl_speedup", "ITL speedup"), ("tok_s_ratio", "tok/s ratio"))]
        sent = {c: sorted({p.cells[c]["n_requests"] for p in ps}) for c in ps[0].meta["workload"]["levels"]}
        requests = ", ".join(f"c = {c} {'/'.join(map(str, n))}" for c, n in sent.items())
        out.append(f"- expert load `{routing_of(ps[0].meta['workload'])}`, {variant} against {BASELINE}: "
                   f"{'; '.join(parts)}; timed requests per process: {requests}.")
    return out
