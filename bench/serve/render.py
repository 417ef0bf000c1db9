"""Markdown of the yardstick: the pooled A/B table, the answers, the step profile, the headline.

`results_table(*dirs)` renders every model in the run directories: per concurrency and variant,
ITL p50, TTFT p50 and output tok/s (geometric means over processes), their ratios to vllm-serve
with 95 % intervals, % of the byte floor, and how many processes; the API server process's CPU
time per output token where recorded; the answers against vllm-serve's; then where the decode
step goes in every profiled process. `headline(rows)` is the first-screen table of RESULTS.md and
README.md: one row per model, format and GPU, the primary metrics of the two expert-load modes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.model_dirs import model_config
from bench.serve import stats as serve_stats
from bench.serve import roofline, trace
from bench.serve.servers import ALL_VARIANTS, BASELINE, OURS, WEIGHTS

PRIMARY = {(1, "itl"), (8, "tok_s")}      # stated before any run: c = 1 ITL p50, c = 8 output tok/s
NOTE = ("Primary metrics, fixed before the runs: **c = 1 ITL p50** (as the weights route) and **c = 8 output "
        "tok/s** (under uniform expert load) (bold). A cell is the geometric mean over n processes (n server "
        "starts, variants in rotated order). Ratios to vllm-serve are oriented so that higher is better for the "
        "variant: ITL and TTFT speedup = vllm-serve's / the variant's, tok/s ratio = the variant's / "
        "vllm-serve's; each is the ratio of geometric means over processes with its 95 % Welch t interval on "
        "logs. % floor = the step at the byte floor (weights read, experts hit under uniform routing, KV cache, "
        "over the measured copy ceiling) / ITL p50.")


def _ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    ci = "n/a" if r["lo"] is None else f"{r['lo']:.3f}, {r['hi']:.3f}"
    return f"{r['ratio']:.3f} [{ci}]"


def _bold(text: str, on: bool) -> str:
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
        itl = _bold(f"{r['itl_p50_ms']:.3f}", (c, "itl") in PRIMARY)
        tok_s = _bold(f"{r['tok_s']:.1f}", (c, "tok_s") in PRIMARY)
        floor_text = "—" if floor is None else f"{floor:.0f} %"
        out.append(f"| {model} | {c} | {r['variant']} | {n} | {itl} | {_ratio(r.get('itl_speedup'))} | "
                   f"{r['ttft_p50_ms']:.1f} | {_ratio(r.get('ttft_speedup'))} | {tok_s} | "
                   f"{_ratio(r.get('tok_s_ratio'))} | {floor_text} |")
    if coalesced:
        out += ["", f"Some streams got several tokens in one chunk (up to {100 * coalesced:.0f} % of a cell's "
                    "requests): their ITL gaps are per chunk, not per token."]
    return out + api_cpu_table(model, procs) + answers_table(model, procs)


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
                           f"{_ratio(r['itl_speedup'])} | {_ratio(r['tok_s_ratio'])} |")
    return out


def step_budget(*dirs: Path) -> list[str]:
    """Per profiled process and level, one row: the decode step and each of its SLICES as
    measured ms (from the profile) and, in parentheses, the slice's floor (its bytes over the run's
    copy ceiling; none under a µs: '-'), then GPU idle."""
    out = ["| model | variant | commit | c | step ms (floor) | " + " | ".join(n for n, _, _ in SLICES) + " | GPU idle |",
           "|---|---|---|---:|---:|" + "---:|" * (len(SLICES) + 1)]
    for p in sorted(serve_stats.load(list(dirs)), key=lambda p: (p.meta["workload"]["model"], p.variant)):
        w, ceiling = p.meta["workload"], p.meta.get("copy_ceiling_bps")
        cfg = model_config(w["model"])
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
                       + f" | {d['gpu_idle_ms']:.3f} |")
    return out


def model_format(model: str) -> str:
    """The weight format of a bench model, from its config's quantization_config."""
    q = (model_config(model) or {}).get("quantization_config") or {}
    if not q:
        return "bf16"
    if q.get("quant_method") == "fp8":
        return "FP8 block" if q.get("weight_block_size") else f"FP8 per-tensor ({q.get('activation_scheme', 'dynamic')})"
    return "FP8-dynamic (per-channel)" if q.get("quant_method") == "compressed-tensors" else q.get("quant_method", "?")


@dataclass(frozen=True)
class HeadlineRow:
    """One first-screen row: a model on one GPU, its run directories as the weights route (c = 1)
    and under realistic load (c = 8 and 64); either may be empty."""

    model: str
    weights_dirs: tuple[Path, ...]
    uniform_dirs: tuple[Path, ...] = ()
    variant: str = OURS
    settings: str = "as shipped"          # how the measured engine differs from what ships, if it does


def _cell(procs: list[serve_stats.Process], c: int, key: str, variant: str) -> tuple[str, dict[str, Any] | None]:
    """A headline cell: the variant's ratio at c with its interval and process counts, and its row."""
    if not procs:
        return "not measured", None
    rows = {(r["level"], r["variant"]): r for r in serve_stats.pooled_rows(procs, BASELINE, ALL_VARIANTS)}
    r, base = rows.get((c, variant)), rows.get((c, BASELINE))
    if not (r and base and r.get(key)):
        return "not measured", None
    ratio = r[key]
    return (_bold(_ratio(ratio), ratio["lo"] is not None and ratio["lo"] > 1)
            + f" ({r['n']} + {base['n']})", r)


def headline(rows: list[HeadlineRow]) -> list[str]:
    """The first-screen table: per model, format and GPU, moe-serve against `vllm serve` at c = 1
    (ITL p50 speedup, as the weights route) and c = 8 and 64 (output tok/s ratio, uniform expert
    load), with 95 % intervals (**bold**: lower bound above 1) and processes (ours + vllm serve's),
    % of the byte floor at c = 1 and c = 64, the commits, and the settings measured."""
    out = ["| model | format | GPU, TP | c = 1 ITL speedup (weights' routing) | c = 8 tok/s (uniform load) "
           "| c = 64 tok/s (uniform load) | % floor c = 1 / 64 | commits | settings |",
           "|---|---|---|---|---|---|---|---|---|"]
    for h in rows:
        weights = serve_stats.load(list(h.weights_dirs))
        uniform = serve_stats.load(list(h.uniform_dirs))
        serve_stats.by_model(weights + uniform, BASELINE)
        c1, r1 = _cell(weights, 1, "itl_speedup", h.variant)
        c8, _ = _cell(uniform, 8, "tok_s_ratio", h.variant)
        c64, r64 = _cell(uniform, 64, "tok_s_ratio", h.variant)
        floors = " / ".join("—" if not r or r.get("floor_pct") is None else f"{r['floor_pct']:.0f} %" for r in (r1, r64))
        p0 = (weights or uniform)[0].meta
        commits = ", ".join(sorted({(p.meta.get("commit") or "unknown")[:7] + ("+dirty" if p.meta.get("dirty") else "")
                                    for p in weights + uniform}))
        out.append(f"| {h.model} | {model_format(h.model)} | {p0.get('gpu', '?')}, TP {p0['workload']['engine']['tensor_parallel_size']} "
                   f"| {c1} | {c8} | {c64} | {floors} | {commits} | {h.settings} |")
    return out
