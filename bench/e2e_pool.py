"""Pool several `bench/e2e_ab.py` runs into one optimized/vllm table (ratios per run + geomean).

    python bench/e2e_pool.py runs/e2e runs/e2e2        # --out dirs of bench/e2e_ab.py runs

One run's step ratios carry the order, the warm-up and the machine's noise; pooling runs made
in both orders (A/B and B/A) shows which effects survive. Per stage: output tok/s, ITL p50 and
TTFT p50 ratios (optimized / vllm) per run and their geometric mean; per scenario: TTFT
p50/p99 over all requests of each run and serving-phase JIT compiles, and the TTFT p50 ratio
pooled over runs with its interval. Prints markdown.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from pathlib import Path

VARIANTS = ("optimized", "vllm")
METRICS = (("output_tok_s", "output tok/s"), ("itl_p50_ms", "ITL p50"), ("ttft_p50_ms", "TTFT p50"))


def load(run: Path, variant: str, scenario: str) -> dict:
    return json.loads((run / variant / scenario / "report.json").read_text())


def ttfts_ms(run: Path, variant: str, scenario: str) -> list[float]:
    """TTFT of every successful request of the scenario, in ms (requests.jsonl, or its .gz)."""
    path = run / variant / scenario / "requests.jsonl"
    text = path.read_text() if path.exists() else gzip.decompress(path.with_suffix(".jsonl.gz").read_bytes()).decode()
    recs = (json.loads(line) for line in text.splitlines())
    return sorted(1000 * r["ttft"] for r in recs if r["status"] == "ok" and r["ttft"] is not None)


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stage_table(runs: list[Path], scenario: str) -> list[str]:
    reps = [{v: load(r, v, scenario) for v in VARIANTS} for r in runs]
    head = "| users | " + " | ".join(f"{name} run {i + 1}" for _, name in METRICS for i in range(len(runs)))
    head += " | " + " | ".join(f"{name} geomean" for _, name in METRICS) + " |"
    lines = [head, "|---:" * (1 + (len(runs) + 1) * len(METRICS)) + "|"]
    for s, stage in enumerate(reps[0]["optimized"]["stages"]):
        per = {k: [rep["optimized"]["stages"][s][k] / rep["vllm"]["stages"][s][k] for rep in reps] for k, _ in METRICS}
        cells = [f"{x:.3f}" for k, _ in METRICS for x in per[k]] + [f"**{statistics.geometric_mean(per[k]):.3f}**" for k, _ in METRICS]
        lines.append(f"| {stage['users']} | " + " | ".join(cells) + " |")
    return lines


def scenario_lines(runs: list[Path], scenario: str) -> list[str]:
    lines = ["| run | variant | requests | TTFT p50 ms | TTFT p99 ms | TTFT max ms | serving JIT compiles |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for i, run in enumerate(runs):
        for v in VARIANTS:
            t = ttfts_ms(run, v, scenario)
            comp = load(run, v, scenario)["serving_jit_compiles"]
            compiles = "n/a" if comp is None else f"{comp['total']:g}"
            lines.append(f"| {i + 1} | {v} | {len(t)} | {pct(t, 0.5):.1f} | {pct(t, 0.99):.1f} | {t[-1]:.1f} | "
                         f"{compiles} |")
    return lines


def ttft_p50_pooled(runs: list[Path], scenario: str, stall_ms: float = 1000.0) -> list[str]:
    """Per run: TTFT p50 of each variant over all requests, their ratio and the share of requests
    slower than stall_ms; then the geomean ratio over runs with its 95 % t interval (the run is
    the unit: log ratios, n - 1 degrees of freedom)."""
    from scipy import stats

    lines = [f"| run | requests (optimized / vllm) | TTFT p50 ms optimized | vllm | ratio | "
             f"requests > {stall_ms:g} ms optimized | vllm |", "|---|---:|---:|---:|---:|---:|---:|"]
    logs = []
    for run in runs:
        t = {v: ttfts_ms(run, v, scenario) for v in VARIANTS}
        p50 = {v: pct(t[v], 0.5) for v in VARIANTS}
        logs.append(math.log(p50["optimized"] / p50["vllm"]))
        slow = {v: 100 * sum(x > stall_ms for x in t[v]) / len(t[v]) for v in VARIANTS}
        lines.append(f"| `{run.name}` | {len(t['optimized'])} / {len(t['vllm'])} | {p50['optimized']:.1f} | "
                     f"{p50['vllm']:.1f} | {p50['optimized'] / p50['vllm']:.3f} | {slow['optimized']:.1f} % | "
                     f"{slow['vllm']:.1f} % |")
    g = math.exp(statistics.fmean(logs))
    lines.append("")
    if len(logs) < 2:
        return lines + [f"TTFT p50 ratio optimized / vllm, one run: {g:.3f}."]
    sd = statistics.stdev(logs)
    half = stats.t.ppf(0.975, len(logs) - 1) * sd / math.sqrt(len(logs))
    need = math.ceil((1.96 * sd / -math.log(0.91)) ** 2)   # runs for a 95 % half-width of 9 %
    return lines + [f"TTFT p50 ratio optimized / vllm over {len(logs)} runs: geomean **{g:.3f}**, 95 % t interval "
                    f"[{math.exp(math.log(g) - half):.3f}, {math.exp(math.log(g) + half):.3f}]; standard deviation "
                    f"of the log ratios {sd:.3f}, so an interval of +-9 % needs about {need} runs."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="--out dirs of e2e_ab.py runs (both variants present)")
    p.add_argument("--scenarios", default="spike-sizes,step")
    a = p.parse_args(argv)
    out = [f"# e2e A/B pooled over {len(a.runs)} runs: optimized / vllm", ""]
    out += [f"- run {i + 1}: `{r}`" for i, r in enumerate(a.runs)]
    for scenario in a.scenarios.split(","):
        out += ["", f"## `{scenario}`: ratios per stage (optimized / vllm; tok/s > 1 and latency < 1 favour optimized)", ""]
        out += stage_table(a.runs, scenario)
        out += ["", f"## `{scenario}`: all requests of the scenario", ""]
        out += scenario_lines(a.runs, scenario)
        out += ["", f"## `{scenario}`: TTFT p50 over runs", ""]
        out += ttft_p50_pooled(a.runs, scenario)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
