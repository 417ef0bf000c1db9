"""Markdown for HISTORY.md's blocks, computed from raw result files (bench/results_tables.py's registry
calls these). Each function takes the raw files' paths and returns the block's lines."""
from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

from e2e_pool import scenario_lines, stage_table, ttft_p50_pooled

PUBLISHED_COPY_BPS = 4.3e12  # the H200 copy ceiling measured before the first kernel bench


def _json(p: Path):
    return json.loads(p.read_text())


def _kernel_rows(rows: list[dict], ceiling: float | None, before: dict | None = None) -> list[str]:
    """One table row per (shape, dtype, M); ceiling None: the row's own *_bw_frac (in-run ceiling)."""
    out = []
    for r in rows:
        key = (r["shape"], r["dtype"], r["M"])
        if "ours_us" not in r:  # the kernel did not run (e.g. OutOfResources): blank measurement cells
            blanks = " |" * (5 if before is not None else 4)
            out.append(f"| {r['shape']} | {r['dtype']} | {r['M']} | {r.get('error', 'error').split(':')[0]} |"
                       f"{blanks} `{r['cfg']}` |")
            continue
        if ceiling is None:
            fo, fv = r["ours_bw_frac"], r["vllm_bw_frac"]
        else:
            fo = r["gbytes_hit"] * 1e9 / (r["ours_us"] * 1e-6) / ceiling
            fv = r["gbytes_hit"] * 1e9 / (r["vllm_us"] * 1e-6) / ceiling
        mid = f"{r['ours_us']:.1f} | {r['vllm_us']:.1f} | {r['speedup']:.2f} | "
        if before is not None:
            mid += f"{before.get(key, float('nan')):.2f} | "
        out.append(f"| {r['shape']} | {r['dtype']} | {r['M']} | {mid}{fo:.2f} | {fv:.2f} | `{r['cfg']}` |")
    return out


def _geomeans(rows: list[dict], max_m: int = 64) -> list[str]:
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if "speedup" in r and r["M"] <= max_m:
            groups.setdefault((r["shape"], r["dtype"]), []).append(r["speedup"])
    return [f"- {shape} {dt}: **{statistics.geometric_mean(v):.2f}x** over {len(v)} M values (min {min(v):.2f}x)"
            for (shape, dt), v in groups.items()]


KERNEL_HEAD = ["| shape | dtype | M | ours µs | vLLM µs | speed-up | ours / 4.3 TB/s | vLLM / 4.3 TB/s | our config |",
               "|---|---|---:|---:|---:|---:|---:|---:|---|"]


def kernel_bench(part: str, path: Path) -> list[str]:
    """Ours vs vLLM per cell (fractions of the published 4.3 TB/s ceiling), then geomeans at M <= 64."""
    rows = _json(path)[part]
    return [*KERNEL_HEAD, *_kernel_rows(rows, PUBLISHED_COPY_BPS), "",
            "Geometric-mean speed-up (ours over vLLM) at M <= 64:", "", *_geomeans(rows)]


def kernel_bench_tuned(path: Path, before_path: Path) -> list[str]:
    """The tuned quick bench against the in-run ceiling, with the untuned run's speed-up per cell."""
    before = {(r["shape"], r["dtype"], r["M"]): r.get("speedup", float("nan"))
              for r in _json(before_path)["bench"]}
    head = ["| shape | dtype | M | ours µs | vLLM µs | speed-up | before tuning | ours / ceiling | vLLM / ceiling "
            "| our config |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    return head + _kernel_rows(_json(path)["bench"], None, before)


def kernel_compiles(path: Path) -> list[str]:
    c = _json(path)["compiles"]
    E, N, K, topk = c["shape"]
    by_kernel = ", ".join(f"{k} {v}" for k, v in c["vllm_serving_by_kernel"].items())
    return [f"**JIT compiles** (`--compiles`, E={E} N={N} K={K} top-{topk} {c['dtype']}, M swept 1..{c['max_m']} "
            f"after warm-up): ours {c['ours_variants']} distinct variants at warm-up, of which the JIT monitor "
            f"counted **{c['ours_warmup_compiles']}** as compiles (Triton's caches already held them from the "
            f"script's earlier parts, so this run does not measure a warm-up compile count), and "
            f"**{c['ours_serving_compiles']}** compiles during the sweep; vLLM's `fused_experts`, after warming "
            f"M = powers of two, **{c['vllm_serving_compiles']}** more compiles during the sweep ({by_kernel})."]


def plugin_check(path: Path) -> list[str]:
    """Per mode; serving compiles only where every worker reached phase serving."""
    out = ["| mode | ready s | workers reporting (phase) | MoE calls ours / fell back to vLLM | warm-up compiles "
           "| serving compiles | requests ok/err |", "|---|---:|---|---|---:|---:|---|"]
    for r in _json(path):
        ws = r.get("workers") or []
        serving = bool(ws) and all(w.get("phase") == "serving" for w in ws)
        la, sw = r.get("launches") or {}, r.get("sweep") or {}
        warm = sum((r.get("warmup_compiles") or {}).values())
        comp = r.get("serving_compiles") or {}
        if serving:
            by = ", ".join(f"`{k}`" for k in comp)
            cell = f"**{sum(comp.values()):.0f}**" + (f" ({by})" if by else "")
        else:
            cell = "n/a: phase never left `warmup`"
        label = r["mode"] if r["mode"] == "optimized" else f"{r['mode']} (stock)"
        phases = ", ".join(w.get("phase", "?") for w in ws)
        out.append(f"| {label} | {r.get('ready_s', '-')} | {len(ws)} ({phases}) | {la.get('optimized', 0):.0f} / "
                   f"{la.get('fallback', 0):.0f} | {warm:.0f}{'' if serving else ' (all compiles)'} | {cell} | "
                   f"{sw.get('ok', 0)}/{sw.get('err', 0)} |")
    return out


def e2e_stages(scenario: str, *runs: Path) -> list[str]:
    return stage_table(list(runs), scenario)


def e2e_all_requests(scenario: str, *runs: Path) -> list[str]:
    return scenario_lines(list(runs), scenario)


def e2e_ttft_pooled(scenario: str, *runs: Path) -> list[str]:
    return ttft_p50_pooled(list(runs), scenario)


def cpu_starvation(path: Path) -> list[str]:
    label = {"unpinned": "unpinned (vLLM's own OMP binding)",
             "pinned": "pinned to the last core (`server_core_isolation`)"}
    out = [f"| server | 0.1 s of client CPU, wall (median / max of {len(_json(path)[0]['trials'])}) "
           "| /health round trip on a raw socket (median / max) |", "|---|---|---|"]
    for m in _json(path):
        cpu = " / ".join(f"{x:.3f} s" if x < 1 else f"{x:.2f} s"
                         for x in (m["median"]["cpu_0.1s_wall_s"], m["max"]["cpu_0.1s_wall_s"]))
        if m["median"]["cpu_0.1s_wall_s"] > 1:
            cpu = f"**{cpu}**"
        rtt = f"{1000 * m['median']['health_rtt_s']:.1f} ms / {1000 * m['max']['health_rtt_s']:.1f} ms"
        out.append(f"| {label.get(m['mode'], m['mode'])} | {cpu} | {rtt} |")
    return out


def _stage_row(report_md: Path, stage: str) -> dict[str, str]:
    lines = [ln for ln in report_md.read_text().splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(ln for ln in lines if ln.startswith(f"| {stage} "))
    return dict(zip(head, (c.strip() for c in row.strip("|").split("|"))))


def _pauses(path: Path) -> list[int]:
    return [int(m) for m in re.findall(r"GCPAUSE gen2 (\d+) ms", path.read_text())]


def gc_freeze(before_md: Path, after_md: Path, before_txt: Path, after_txt: Path) -> list[str]:
    out = ["| 32 users, same command | TTFT p50 | TTFT p99 | ITL p99 |", "|---|---:|---:|---:|"]
    for name, md in (("before the freeze", before_md), ("after", after_md)):
        r = _stage_row(md, "u32")
        p99 = f"**{r['TTFT p99 ms']} ms**" if name.startswith("before") else f"{r['TTFT p99 ms']} ms"
        out.append(f"| {name} | {r['TTFT p50 ms']} ms | {p99} | {float(r['ITL p99 ms']):.1f} ms |")
    b, a = _pauses(before_txt), _pauses(after_txt)
    out += ["", f"Gen-2 pauses logged: before the freeze {len(b)}, longest {max(b)} ms; after it {len(a)}, "
            f"longest {max(a)} ms ({', '.join(str(x) for x in a)} ms, in log order)."]
    return out


def _cells(md: Path) -> list[list[str]]:
    rows = [ln for ln in md.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| stage")
            and not ln.startswith("| users")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]


FRONT_METRICS = (("tok/s", True, 1), ("TTFT p50", False, 1), ("TTFT p99", False, 1), ("ITL p50", False, 2))
ISSUE_USERS = (1, 4, 16, 64)


def _within(ratio: float, higher_is_better: bool) -> bool:
    """Ours within 5 % of vLLM, or better."""
    return ratio >= 0.95 if higher_is_better else ratio <= 1.05


def frontend(summary_md: Path, *reps: Path) -> list[str]:
    """Medians of the repetitions and their ratio (frontend_vs_vllm.py's summary; bold: a cell at
    the issue's concurrencies more than 5 % worse than vLLM), and the count of cells within 5 %
    by both readings of 'median': ratio of the medians, median of the per-repetition ratios."""
    head = ["| users | tok/s vLLM | tok/s ours | ratio | TTFT p50 ms vLLM | ours | ratio | TTFT p99 ms vLLM | ours "
            "| ratio | ITL p50 ms vLLM | ours | ratio |", "|---:" * 13 + "|"]
    rows, of_medians = [], {}
    for c in _cells(summary_md):
        users, vals, cells = int(c[0]), [float(x) for x in c[1:]], []
        for i, (_, higher, digits) in enumerate(FRONT_METRICS):
            v, o, ratio = vals[3 * i: 3 * i + 3]
            of_medians[(users, i)] = ratio
            r = f"{ratio:.3f}"
            cells += [f"{v:.{digits}f}", f"{o:.{digits}f}",
                      f"**{r}**" if users in ISSUE_USERS and not _within(ratio, higher) else r]
        rows.append(f"| {users} | " + " | ".join(cells) + " |")
    per_rep: dict[tuple[int, int], list[float]] = {}
    for rep in reps:
        for c in _cells(rep):
            for i in range(len(FRONT_METRICS)):
                per_rep.setdefault((int(c[1]), i), []).append(float(c[5 + 3 * i]))  # B/A = ours / vLLM
    keys = [(u, i) for u in ISSUE_USERS for i in range(len(FRONT_METRICS))]
    a = sum(_within(of_medians[k], FRONT_METRICS[k[1]][1]) for k in keys)
    b = sum(_within(statistics.median(per_rep[k]), FRONT_METRICS[k[1]][1]) for k in keys)
    misses = [f"{FRONT_METRICS[i][0]} at {u} user{'s' if u > 1 else ''} ({statistics.median(per_rep[(u, i)]):.3f})"
              for u, i in keys if not _within(statistics.median(per_rep[(u, i)]), FRONT_METRICS[i][1])]
    return head + rows + ["", f"At the issue's concurrencies ({', '.join(map(str, ISSUE_USERS))}), ours is within 5 % "
                          f"of vLLM or better in **{a} of {len(keys)}** cells by the ratio of the medians (this table), "
                          f"and in **{b} of {len(keys)}** by the median of the {len(reps)} per-repetition ratios (misses "
                          f"by that reading: {'; '.join(misses)})."]


def idle_probe(path: Path) -> list[str]:
    d = _json(path)
    out = ["| idle gap s | moe-serve ms | vllm-api-server ms |", "|---:|---:|---:|"]
    for i, ((gap, ours), (_, theirs)) in enumerate(zip(d["moe-serve"], d["vllm-api-server"])):
        label = "0 (first after start)" if i == 0 else f"{gap:g}"
        out.append(f"| {label} | {ours:.1f} | {theirs:.1f} |")
    return out


def _ttft(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{1000 * s:.0f} ms"


def soak(path: Path) -> list[str]:
    s = _json(path)
    return ["| requests | ok | errors | cut off at end | output tokens | API RSS after warm-up → end | growth "
            "| TTFT p99 first 5 min → last 5 min |", "|---:|---:|---:|---:|---:|---|---:|---|",
            f"| {s['requests']:,} | {s['ok']:,} | **{s['errors']}** | {s['requests'] - s['ok'] - s['errors']} | "
            f"{s['output_tokens']:,} | {s['rss_mib_after_warmup']} → {s['rss_mib_end']} MiB (max {s['rss_max_mib']}) "
            f"| **{s['rss_growth_pct']:.2f} %** | {_ttft(s['ttft_p99_first_window_s'])} → "
            f"{_ttft(s['ttft_p99_last_window_s'])} |"]


def soak_curve(rss_csv: Path, soak_json: Path, every_s: float = 120, warm_min: float = 5) -> list[str]:
    """RSS after warm-up -> end as a slope, and the first sample at or after every `every_s`."""
    rows = [(float(t), float(r)) for t, r in list(csv.reader(rss_csv.open()))[1:]]
    s = _json(soak_json)
    slope = (s["rss_mib_end"] - s["rss_mib_after_warmup"]) / (s["minutes"] - warm_min)
    marks = [next(r for t, r in rows if t >= k * every_s) for k in range(1, int(rows[-1][0] // every_s) + 1)]
    series = ", ".join(f"{r:.1f}" for r in marks)
    per_min = s["requests"] / s["minutes"]
    return [f"RSS {s['rss_mib_after_warmup']} MiB after the {warm_min:g}-minute warm-up, {s['rss_mib_end']} MiB at "
            f"the end: **{slope:.2f} MiB/min** over the {s['minutes'] - warm_min:g} minutes after warm-up, "
            f"{1024 * slope / per_min:.1f} KiB per request at {per_min / 60:.1f} requests/s. Every {every_s / 60:g} minutes from minute {every_s / 60:g} (first sample at or after the mark): "
            f"{series} MiB."]
