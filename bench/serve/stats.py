"""The yardstick's numbers from its raw files: per process and cell, then pooled over processes.

A process is one server start: DIR/<variant>/r<round>/ with meta.json, requests.jsonl and a
`complete` marker (unfinished processes are ignored). Its cell at concurrency c, from the
measured requests at c:

- ITL p50: the median of every chunk gap of every request (ms); chunks are tokens unless the
  server coalesced (then `coalesced` > 0: the share of requests with fewer chunks than tokens);
- TTFT p50: the median time to first token (ms);
- output tok/s: all output tokens / (last request's end - first request's start);
- % byte floor: the step at the byte floor (roofline.byte_floor: the weights a step of c tokens
  reads, experts hit under uniform routing, and the KV cache, over the copy ceiling) / ITL p50;
- API CPU per token (processes with api_cpu.json): the server's API process's CPU microseconds
  over the level (its warm-up and measured requests) / the output tokens it streamed meanwhile.

A cell with a failed request is left out of the pool (and counted). Pooled over processes, a
cell is the geometric mean; its ratio to the baseline is the ratio of geometric means with a
95 % Welch interval on logs (moe_serve.bench.stats.ratio_ci), oriented so that higher is better for the
variant: ITL and TTFT speedup = baseline / variant, tok/s = variant / baseline, API CPU =
baseline / variant.

Processes are pooled per model across directories (machines, sessions); runs of one model whose
workload (levels, prompt and output tokens, prompt ids, engine flags, expert-load mode, model
config) differs are refused, and so are processes whose resolved engine configuration (meta's
`engine_config`) differs from the baseline's beyond the variant's own switch
(servers.VARIANT_CONFIG_KEYS), and processes that recorded different vLLM MoE tables.
Answers (answers.json) are compared with the baseline's first process: its other processes give
the noise floor.
"""
from __future__ import annotations

import json
import lzma
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_serve.bench.model_dirs import model_config_of_run
from moe_serve.bench.serve import answers, roofline
from moe_serve.bench.serve.servers import VARIANT_CONFIG_KEYS, WEIGHTS, config_differences
from moe_serve.bench.stats import ratio_ci

COMPLETE = "complete"
REQUESTS = "requests.jsonl"
API_CPU = "api_cpu.json"
WORKLOAD_KEYS = ("model", "config_sha256", "levels", "prompt_tokens", "output_tokens", "engine",
                 "warmup_pass", "prompt_vocab")


@dataclass
class Process:
    """One complete process: its meta.json and its cells by concurrency."""

    dir: Path
    meta: dict[str, Any]
    cells: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        return self.meta["variant"]


def workload(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta["workload"].get(k, False) for k in WORKLOAD_KEYS}   # older runs: no warm-up pass, vocab


def read_text(d: Path, name: str) -> str | None:
    """A process file as the run wrote it, or the compressed copy kept as evidence (name.xz);
    None when neither is there."""
    plain, packed = d / name, d / (name + ".xz")
    if plain.is_file():
        return plain.read_text()
    return lzma.decompress(packed.read_bytes()).decode() if packed.is_file() else None


def read_records(d: Path) -> list[dict[str, Any]]:
    """A process's request records (requests.jsonl, or its .xz copy); a torn last line (killed
    writer) is skipped."""
    text = read_text(d, REQUESTS)
    if text is None:
        raise FileNotFoundError(d / REQUESTS)
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def cell(records: list[dict[str, Any]], output_tokens: int, floor_s: float | None) -> dict[str, Any]:
    """One process's numbers at one level from its measured records."""
    bad = [r for r in records if r["status"] != "ok"]
    if bad or not records:
        return {"n_requests": len(records), "errors": len(bad) or 1,
                "error": bad[0]["error"] if bad else "no measured requests"}
    gaps = [g for r in records for g in r["itl_us"]]
    itl = statistics.median(gaps) / 1e3 if gaps else float("nan")
    window = max(r["t_end"] for r in records) - min(r["t_start"] for r in records)
    return {"n_requests": len(records), "errors": 0, "itl_p50_ms": itl,
            "ttft_p50_ms": statistics.median(r["ttft"] for r in records) * 1e3,
            "tok_s": sum(r["output_tokens"] for r in records) / window,
            "coalesced": sum(r["chunks"] < output_tokens for r in records) / len(records),
            "floor_pct": None if floor_s is None else 100 * floor_s * 1e3 / itl}


def floor_bytes(meta: dict[str, Any]) -> dict[str, float]:
    """Per level (str): the byte floor's bytes, as the run recorded them, else from the model's
    config in bench/models when it is the one the run used (its hash); {} when neither."""
    if meta.get("floor_bytes"):
        return meta["floor_bytes"]
    w = meta["workload"]
    cfg = model_config_of_run(w["model"], w["config_sha256"])
    if cfg is None:
        return {}
    context = w["prompt_tokens"] + w["output_tokens"] / 2
    try:
        return {str(c): roofline.byte_floor(cfg, w["engine"]["tensor_parallel_size"], c, context)["total"]
                for c in w["levels"]}
    except (ValueError, KeyError):
        return {}


def load_process(d: Path) -> Process:
    meta = json.loads((d / "meta.json").read_text())
    p = Process(d, meta)
    w = meta["workload"]
    ceiling, bytes_at = meta.get("copy_ceiling_bps"), floor_bytes(meta)
    records = [r for r in read_records(d) if r.get("phase") == "measured"]
    api_cpu = json.loads((d / API_CPU).read_text()) if (d / API_CPU).is_file() else {}
    for c in w["levels"]:
        roof = bytes_at[str(c)] / ceiling if ceiling and str(c) in bytes_at else None
        p.cells[c] = cell([r for r in records if r["level"] == c], w["output_tokens"], roof)
        spent = api_cpu.get(str(c))
        if spent and spent["output_tokens"] and not p.cells[c]["errors"]:
            p.cells[c]["api_cpu_us_tok"] = spent["cpu_s"] * 1e6 / spent["output_tokens"]
    if (profile := read_text(d, "profile.json")) is not None:
        p.meta["profile"] = json.loads(profile)
    if (d / answers.ANSWERS).is_file():
        p.meta["answers"] = json.loads((d / answers.ANSWERS).read_text())
    return p


def process_dirs(run_dir: Path) -> list[Path]:
    """DIR/<variant>/r<round>/ of every complete process."""
    return [r for v in sorted(run_dir.iterdir()) if v.is_dir()
            for r in sorted(v.glob("r*")) if (r / COMPLETE).is_file()]


def load(dirs: list[Path | str]) -> list[Process]:
    """Every complete process under the given run directories."""
    return [load_process(p) for d in dirs for p in process_dirs(Path(d))]


def by_model(procs: list[Process], baseline: str) -> dict[str, list[Process]]:
    """Processes grouped by model and expert-load mode ("model (routing)"); SystemExit when one
    group's processes ran different workloads or engine configurations (config_mismatches)."""
    out: dict[str, list[Process]] = {}
    for p in procs:
        w = p.meta["workload"]
        out.setdefault(f"{w['model']} ({w['engine'].get('routing', WEIGHTS)})", []).append(p)
    for model, ps in out.items():
        kinds = {json.dumps(workload(p.meta), sort_keys=True) for p in ps}
        if len(kinds) > 1:
            raise SystemExit(f"{model}: runs of different workloads, not pooled:\n" + "\n".join(sorted(kinds)))
        bad = config_mismatches(ps, baseline)
        if bad:
            raise SystemExit(f"{model}: processes whose engine configuration differs from {baseline}'s, not pooled:\n"
                             + "\n".join(f"{d}: {diff}" for d, diff in bad))
        tables = {json.dumps(p.meta["vllm_moe_table"], sort_keys=True) for p in ps if "vllm_moe_table" in p.meta}
        if len(tables) > 1:
            raise SystemExit(f"{model}: processes that ran different vLLM MoE tables, not pooled:\n" + "\n".join(sorted(tables)))
    return out


def config_mismatches(procs: list[Process], baseline: str) -> list[tuple[str, dict[str, tuple]]]:
    """(process dir, differences) for every process whose recorded engine configuration differs
    from the first baseline process's, beyond its variant's own switch (VARIANT_CONFIG_KEYS).
    Processes that recorded none (runs before the yardstick read it) are not compared."""
    recorded = [p for p in procs if p.meta.get("engine_config")]
    ref = next((p for p in sorted(recorded, key=lambda p: p.meta["round"]) if p.variant == baseline), None)
    if ref is None:
        return []
    return [(str(p.dir), diff) for p in recorded
            if (diff := config_differences(ref.meta["engine_config"], p.meta["engine_config"],
                                           VARIANT_CONFIG_KEYS.get(p.variant, ())))]


def answer_rows(procs: list[Process], baseline: str) -> list[dict[str, Any]]:
    """Per variant (the baseline's own other processes first: the noise floor): how many processes'
    answers were compared with the baseline's first process, the lowest top-1 agreement and the
    largest log-probability difference among them. [] where the baseline recorded no answers."""
    said = sorted((p for p in procs if p.meta.get("answers")), key=lambda p: (p.variant != baseline, p.meta["round"]))
    if not said or said[0].variant != baseline:
        return []
    ref, rows = said[0], {}
    for p in said[1:]:
        c = answers.compare(ref.meta["answers"], p.meta["answers"])
        row = rows.setdefault(p.variant, {"variant": p.variant, "n": 0, "positions": c["positions"],
                                          "top1_agreement": 1.0, "max_logprob_diff": 0.0})
        row["n"] += 1
        row["top1_agreement"] = min(row["top1_agreement"], c["top1_agreement"])
        row["max_logprob_diff"] = max(row["max_logprob_diff"], c["max_logprob_diff"])
    return list(rows.values())


def _geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs)


def _inverse(cells: list[dict[str, Any]], key: str) -> list[float]:
    """1 / each cell's value: a ratio of these is the speedup baseline / variant."""
    return [1.0 / x[key] for x in cells]


def pooled_rows(procs: list[Process], baseline: str, variants: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per (level, variant) of one model's processes (variants in the given order, then
    any other): n processes, geomean cells, ratios to the baseline with their intervals."""
    names = list(variants) + sorted({p.variant for p in procs} - set(variants))
    rows = []
    for c in procs[0].meta["workload"]["levels"]:
        ok = {v: [p.cells[c] for p in procs if p.variant == v and p.cells[c]["errors"] == 0] for v in names}
        base = ok.get(baseline) or []
        for v in names:
            good = ok[v]
            failed = sum(1 for p in procs if p.variant == v and p.cells[c]["errors"])
            if not good and not failed:
                continue
            row: dict[str, Any] = {"level": c, "variant": v, "n": len(good), "failed": failed}
            if good:
                for key in ("itl_p50_ms", "ttft_p50_ms", "tok_s"):
                    row[key] = _geomean([x[key] for x in good])
                floor = [x["floor_pct"] for x in good if x["floor_pct"] is not None]
                row["floor_pct"] = statistics.fmean(floor) if floor else None
                row["coalesced"] = max(x["coalesced"] for x in good)
            cpu = [x for x in good if "api_cpu_us_tok" in x]
            if cpu:
                row["api_cpu_n"], row["api_cpu_us_tok"] = len(cpu), _geomean([x["api_cpu_us_tok"] for x in cpu])
            if good and base and v != baseline:
                row["itl_speedup"] = ratio_ci(_inverse(good, "itl_p50_ms"), _inverse(base, "itl_p50_ms"))
                row["ttft_speedup"] = ratio_ci(_inverse(good, "ttft_p50_ms"), _inverse(base, "ttft_p50_ms"))
                row["tok_s_ratio"] = ratio_ci([x["tok_s"] for x in good], [x["tok_s"] for x in base])
                base_cpu = [x for x in base if "api_cpu_us_tok" in x]
                if cpu and base_cpu:
                    row["api_cpu_ratio"] = ratio_ci(_inverse(cpu, "api_cpu_us_tok"), _inverse(base_cpu, "api_cpu_us_tok"))
            rows.append(row)
    return rows


def machines(procs: list[Process]) -> list[tuple[str, str, str, int]]:
    """(host, GPU, commit, processes) of the runs, most processes first."""
    count: dict[tuple[str, str, str], int] = {}
    for p in procs:
        m = p.meta
        commit = (m.get("commit") or "unknown")[:10] + ("+dirty" if m.get("dirty") else "")
        key = (m.get("host", "?"), m.get("gpu", "?"), commit)
        count[key] = count.get(key, 0) + 1
    return sorted(((*k, n) for k, n in count.items()), key=lambda t: -t[3])
