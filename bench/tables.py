"""The generated tables of bench/RESULTS.md and README.md, recomputed from bench/results/.

    moe-serve bench tables            # rewrite every generated block from the raw files
    moe-serve bench tables --check    # exit 1 with a diff where a document differs (CI runs it)

A generated block sits between two marker lines::

    <!-- results_tables: NAME -->
    ...generated, do not edit...
    <!-- /results_tables -->

REGISTRY maps NAME to the function that renders it from one claim's folder under bench/results/
(named by what it measures: serve-<model>-<format>-<gpu>-<date>, kernels-...-<date>). A new
claim: its folder, one REGISTRY entry, the two marker lines where the table goes.
"""
from __future__ import annotations

import argparse
import difflib
import json
import lzma
import re
import sys
from collections.abc import Callable
from pathlib import Path

from moe_serve.bench.experts.render import shape_table
from moe_serve.bench.serve.render import HeadlineRow, headline, pairwise_table, results_table, step_budget

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
DOCS = (BENCH / "RESULTS.md", BENCH.parent / "README.md")
BLOCK = re.compile(r"(<!-- results_tables: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results_tables -->)", re.S)


def runs(claim: str) -> tuple[Path, ...]:
    """The run directories of one claim's folder (each holds <variant>/r<round>/ processes);
    SystemExit where a process ran from a tree with uncommitted changes (not publishable)."""
    found = tuple(sorted(p for p in (RESULTS / claim).iterdir() if p.is_dir()))
    if not found:
        raise FileNotFoundError(f"no runs under {RESULTS / claim}")
    dirty = [m.parent for m in (RESULTS / claim).rglob("meta.json") if json.loads(m.read_text()).get("dirty") is True]
    if dirty:
        raise SystemExit(f"{claim}: {len(dirty)} processes ran from a tree with uncommitted changes, not published "
                         f"(e.g. {dirty[0]})")
    return found


QWEN3_BF16 = "serve-qwen3-30b-a3b-bf16-h200-2026-12-04"
QWEN3_BF16_NOW = "serve-qwen3-30b-a3b-bf16-h200-2026-12-06"
QWEN3_BF16_UNIFORM = "serve-qwen3-30b-a3b-bf16-uniform-h200-2026-12-06"
QWEN3_BF16_H100 = "serve-qwen3-30b-a3b-bf16-h100-2026-12-06"
QWEN3_BF16_H100_TUNED = "serve-qwen3-30b-a3b-bf16-h100-tuned-2026-12-06"
QWEN3_FP8_BLOCK_H100_TUNED = "serve-qwen3-30b-a3b-fp8-block-h100-tuned-2026-12-06"
MIXTRAL_BF16 = "serve-mixtral-8x7b-bf16-h200-2026-12-03"
QWEN3_FP8_BLOCK = "serve-qwen3-30b-a3b-fp8-block-h200-2026-12-04"
QWEN3_FP8_DYNAMIC = "serve-qwen3-30b-a3b-fp8-dynamic-h200-2026-12-03"
KERNELS = "kernels-moe-layer-h200-2026-12-04"
KERNELS_DENSE_H100 = "kernels-dense-h100-2026-12-06"
EXPERT_LOAD_CHECK_H100 = "expert-load-check-h100-2026-12-06"
MOE_TUNE_H100 = "kernels-moe-tune-h100-2026-12-06"
STEP_PIECES_H100 = "kernels-step-pieces-qwen3-30b-a3b-h100-vllm-2026-12-07"
STEP_SWITCHES_H100 = "step-switches-qwen3-30b-a3b-h100-2026-12-07"
STEP_ATTENTION_H100 = "step-switches-qwen3-30b-a3b-h100-attention-2026-12-07"
STEP_FP8_H100 = "step-switches-qwen3-30b-a3b-fp8-block-h100-2026-12-07"
PIECES_ATTENTION_FP8_H100 = "kernels-step-pieces-attention-fp8-h100-2026-12-07"
ATTENTION_WIDE_LOADS_H100 = "kernels-decode-attention-wide-loads-h100-2026-12-07"
DENSE_FP8_H100 = "kernels-dense-fp8-block-h100-2026-12-07"
STEP_FP8_TABLES_H100 = "step-switches-qwen3-30b-a3b-fp8-block-dense-tables-h100-2026-12-07"
MOE_VS_VLLM_H100 = "kernels-moe-vs-vllm-qwen3-30b-a3b-h100-2026-12-07"
MOE_FP8_VS_VLLM_H100 = "kernels-moe-fp8-vs-vllm-qwen3-30b-a3b-h100-2026-12-07"
QWEN3_BF16_H100_FAIR = "serve-qwen3-30b-a3b-bf16-h100-fair-2026-12-07"
LOG_STAMP = re.compile(r"^\[[\w-]+ \+ *[\d.]+s\] ")
PREFILL_2048 = "prefill budget 2048 tokens (`vllm serve`: 8192)"


H200_TABLE = "not recorded (vLLM 0.26 ships `E=128,N=768,device_name=NVIDIA_H200{}.json`, which it loads by default)"
H100_DEFAULT = "not recorded (vLLM default on H100: vLLM 0.26 ships no `E=128,N=768` table for it)"
H200_MIXTRAL = "not recorded (vLLM 0.26 ships `E=8,N=14336,device_name=NVIDIA_H200.json`, which it loads by default)"
H200_FP8_CHANNEL = "not recorded (vLLM 0.26 ships no fp8_w8a8 `E=128,N=768` table for the H200: its default)"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _measure_c1(model: str) -> str:
    """The command that measures a model's c = 1 headline row against `vllm serve` with vLLM's
    kernel tuned on this GPU (vLLM's shipped table, where it has one, is among the tuner's
    candidates), the tables in a folder of the model's own (a run refuses a folder whose content
    changed under it)."""
    tuned = f"runs/vllm-tables-{model}"
    return (f"moe-serve tune --for-vllm --model bench/models/{model} --out {tuned} && moe-serve bench serve "
            f"--model {model} --concurrency 1 --variants vllm-serve,moe-serve --processes 3 "
            f"--vllm-tuned-config-folder {tuned} --out runs/serve-{model}-c1")


def _pending(model: str, gpu: str) -> HeadlineRow:
    return HeadlineRow(model, gpu=gpu, settings="main's defaults against `vllm serve` with its MoE table tuned on "
                                                 "this GPU", command=_measure_c1(model))


def _headline_rows() -> list[HeadlineRow]:
    """Rows measured at moe-serve's defaults of their commits against `vllm serve` with its best MoE
    table (the H100: tuned for vLLM's kernel; the H200: the table vLLM ships, before expert-load
    counting, free since), then the rows of the fair yardstick still to measure."""
    return [
        HeadlineRow("qwen3-30b-a3b", runs(QWEN3_BF16_H100_FAIR), settings="main's defaults of its commit; `vllm serve` "
                    "with its MoE table tuned on this GPU by `moe-serve tune --for-vllm` (2 min)"),
        HeadlineRow("qwen3-30b-a3b", runs(QWEN3_BF16_NOW), runs(QWEN3_BF16_UNIFORM), baseline_table=H200_TABLE.format(""),
                    settings="defaults of its commit (before expert-load counting)"),
        _pending("qwen3-30b-a3b", H200),
        _pending("qwen3-30b-a3b-fp8-block", H100),
        _pending("qwen3-30b-a3b-fp8-block", H200),
    ]


def _headline_prose() -> list[str]:
    from moe_serve.bench.serve.headline_prose import prose   # the headline's sentences, from the same rows

    return prose(_headline_rows())


def _summary(*dirs: Path) -> list[str]:
    from moe_serve.bench.serve.ab_tables import summary_lines   # a section's numbers, from its raw files
    from moe_serve.bench.serve.stats import load

    return summary_lines(load(list(dirs)), "moe-serve")


def _headline_older() -> list[str]:
    """Rows that no longer hold: against an untuned `vllm serve`, or at settings that no longer
    ship; not in the headline until measured again."""
    return headline([
        HeadlineRow("qwen3-30b-a3b", runs(QWEN3_BF16_H100_TUNED), baseline_table=H100_DEFAULT,
                    settings="`vllm serve` ran vLLM's untuned default MoE config while ours ran tables tuned on "
                             "that H100 in the same session: superseded by the fair row"),
        HeadlineRow("qwen3-30b-a3b-fp8-block", runs(QWEN3_FP8_BLOCK_H100_TUNED), baseline_table=H100_DEFAULT,
                    settings="as the row above: `vllm serve` untuned (its default, Triton FP8 MoE backend)"),
        HeadlineRow("qwen3-30b-a3b", runs(QWEN3_BF16_H100), baseline_table=H100_DEFAULT,
                    settings="no H100 MoE tables (heuristic configs); dense GEMV off"),
        HeadlineRow("qwen3-30b-a3b", runs(QWEN3_BF16), variant="moe-serve-fused-router", settings=PREFILL_2048,
                    baseline_table=H200_TABLE.format("")),
        HeadlineRow("mixtral-8x7b", runs(MIXTRAL_BF16), settings=PREFILL_2048, baseline_table=H200_MIXTRAL),
        HeadlineRow("qwen3-30b-a3b-fp8-block", runs(QWEN3_FP8_BLOCK), settings=PREFILL_2048,
                    baseline_table=H200_TABLE.format(",dtype=fp8_w8a8,block_shape=[128,128]")),
        HeadlineRow("qwen3-30b-a3b-fp8-dynamic", runs(QWEN3_FP8_DYNAMIC), settings=PREFILL_2048,
                    baseline_table=H200_FP8_CHANNEL),
    ])


def _dense(claim: str) -> list[str]:
    from moe_serve.bench.experts.dense import table   # torch and triton: only when this block renders

    return table(json.loads(lzma.decompress((RESULTS / claim / "results.json.xz").read_bytes()))["dense"])


def _step_pieces(claim: str, name: str = "kernels.json.xz") -> list[str]:
    """`moe-serve bench step --kernels-only`'s table and its predicted saving at M = 1, from the
    claim's kernels.json (xz) of that name."""
    from moe_serve.bench.step import kernel_level

    rows = json.loads(lzma.decompress((RESULTS / claim / name).read_bytes()))["rows"]
    saved = kernel_level.predicted_savings(rows, 1)
    return [kernel_level.table(rows), "",
            "Predicted change of a decode step at M = 1, per switch (chain minus fused, times the pieces a "
            "step runs; negative: the switch would cost): "
            + ", ".join(f"{k} {v:+.0f} us" for k, v in saved.items())]


def _step_switches(claim: str) -> list[str]:
    """`moe-serve bench step --model-only`'s tables: step time per switch set, then the step slice
    by slice."""
    from moe_serve.bench.step import model_level

    found = runs(claim)
    return [*(model_level.table(model_level.summary(d)) for d in found), "", *step_budget(*found)]


def _check_log(claim: str, name: str) -> list[str]:
    """A check's timings and verdict from its log: every "cost" line and the summary line, as a
    list (time stamps dropped; the summary cut to 200 characters, a BAD reason can be long)."""
    lines = [LOG_STAMP.sub("", ln) for ln in (RESULTS / claim / name).read_text().splitlines()]
    return ([f"- {ln}" for ln in lines if ln.startswith("cost ")]
            + [f"- {ln[:200]}" for ln in lines if " checks OK" in ln])


def _tune_logs(claim: str) -> list[str]:
    """Each shape's summary line of `moe-serve tune` (its search time, ours against vLLM's
    fused_experts at M = 1, 8, 64, the routed range), from the claim's tune-*.log files."""
    return [f"- {ln.removeprefix('[tune] ')}" for log in sorted((RESULTS / claim).glob("tune-*.log"))
            for ln in log.read_text().splitlines() if ln.startswith("[tune] ") and ": tuned in " in ln]


def _kernels(*names: str) -> Callable[[], list[str]]:
    return lambda: shape_table(*(RESULTS / KERNELS / n for n in names))


REGISTRY: dict[str, Callable[[], list[str]]] = {
    "headline": lambda: headline(_headline_rows()),
    "headline-prose": _headline_prose,
    "headline-older": _headline_older,
    "serve-qwen3-30b-a3b-bf16": lambda: results_table(*runs(QWEN3_BF16), note=False),
    "serve-qwen3-30b-a3b-bf16-now": lambda: results_table(*runs(QWEN3_BF16_NOW), *runs(QWEN3_BF16_UNIFORM),
                                                          note=False),
    "serve-qwen3-30b-a3b-bf16-now-summary": lambda: _summary(*runs(QWEN3_BF16_NOW), *runs(QWEN3_BF16_UNIFORM)),
    "serve-mixtral-8x7b-bf16": lambda: results_table(*runs(MIXTRAL_BF16), note=False),
    "serve-qwen3-30b-a3b-fp8-block": lambda: results_table(*runs(QWEN3_FP8_BLOCK), note=False),
    "serve-qwen3-30b-a3b-fp8-dynamic": lambda: results_table(*runs(QWEN3_FP8_DYNAMIC), note=False),
    "serve-qwen3-30b-a3b-bf16-h100": lambda: results_table(*runs(QWEN3_BF16_H100), note=False),
    "serve-qwen3-30b-a3b-bf16-h100-fair": lambda: results_table(*runs(QWEN3_BF16_H100_FAIR), note=False),
    "serve-qwen3-30b-a3b-bf16-h100-switches": lambda: pairwise_table(
        *runs(QWEN3_BF16_H100), pairs=(("moe-serve", "moe-serve-no-expert-stats"), ("moe-serve-dense-gemv", "moe-serve"))),
    "serve-qwen3-30b-a3b-h100-tuned": lambda: results_table(*runs(QWEN3_BF16_H100_TUNED),
                                                            *runs(QWEN3_FP8_BLOCK_H100_TUNED), note=False),
    "serve-qwen3-30b-a3b-bf16-h100-tuned-switches": lambda: pairwise_table(
        *runs(QWEN3_BF16_H100_TUNED), pairs=(("moe-serve", "moe-serve-no-expert-stats"),)),
    "kernels-moe-tune-h100": lambda: _tune_logs(MOE_TUNE_H100),
    "expert-load-check-h100-graphs": lambda: _check_log(EXPERT_LOAD_CHECK_H100, "expert-load-check-graphs-64ac467.log"),
    "kernels-dense-h100": lambda: _dense(KERNELS_DENSE_H100),
    "kernels-step-pieces-h100": lambda: _step_pieces(STEP_PIECES_H100),
    "expert-load-check-h100": lambda: _check_log(EXPERT_LOAD_CHECK_H100, "expert-load-check.log"),
    "step-budget": lambda: step_budget(*runs(QWEN3_BF16), *runs(MIXTRAL_BF16)),
    "step-switches-h100": lambda: _step_switches(STEP_SWITCHES_H100),
    "step-switches-attention-h100": lambda: _step_switches(STEP_ATTENTION_H100),
    "step-switches-fp8-h100": lambda: _step_switches(STEP_FP8_H100),
    "kernels-step-pieces-attention-h100": lambda: _step_pieces(PIECES_ATTENTION_FP8_H100, "kernels-attention.json.xz"),
    "kernels-step-pieces-fp8-h100": lambda: _step_pieces(PIECES_ATTENTION_FP8_H100, "kernels-fp8.json.xz"),
    "kernels-decode-attention-wide-loads-h100": lambda: _step_pieces(ATTENTION_WIDE_LOADS_H100),
    "kernels-dense-fp8-h100": lambda: _dense(DENSE_FP8_H100),
    "step-switches-fp8-tables-h100": lambda: _step_switches(STEP_FP8_TABLES_H100),
    "kernels-moe-vs-vllm-h100": lambda: shape_table(RESULTS / MOE_VS_VLLM_H100 / "results.json"),
    "kernels-moe-fp8-vs-vllm-h100": lambda: shape_table(RESULTS / MOE_FP8_VS_VLLM_H100 / "results-block.json",
                                                        RESULTS / MOE_FP8_VS_VLLM_H100 / "results-dynamic.json"),
    "kernels-moe-layer": _kernels("2026-12-01-tuned-fine-m.json", "2026-12-01-untuned.json",
                                  "2026-12-01-tp2-tp1-validation.json"),
    "kernels-fp8-formats": _kernels("2026-12-04-fp8-formats.json"),
}


def _names(texts: dict[Path, str]) -> set[str]:
    """The block names the documents hold; raises on a name REGISTRY does not know or on a REGISTRY
    entry no document holds (before any rendering)."""
    names = {m["name"] for text in texts.values() for m in BLOCK.finditer(text)}
    if unknown := names - set(REGISTRY):
        raise KeyError(f"blocks {sorted(unknown)} are not in REGISTRY")
    if unused := set(REGISTRY) - names:
        raise KeyError(f"REGISTRY entries without a block in {', '.join(p.name for p in texts)}: {sorted(unused)}")
    return names


def render(texts: dict[Path, str]) -> dict[Path, str]:
    """Every document with every block regenerated from its raw files (each block rendered once)."""
    cache = {name: "\n".join(REGISTRY[name]()) for name in sorted(_names(texts))}
    return {path: BLOCK.sub(lambda m: m.group(1) + cache[m["name"]] + "\n" + m.group(4), text)
            for path, text in texts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-serve bench tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a document differs")
    p.add_argument("docs", nargs="*", type=Path, default=list(DOCS),
                   help="the documents holding every block (default: bench/RESULTS.md, README.md)")
    a = p.parse_args(argv)
    old = {d: d.read_text() for d in a.docs}
    new = render(old)
    changed = [d for d in a.docs if new[d] != old[d]]
    if a.check:
        for d in changed:
            sys.stdout.writelines(difflib.unified_diff(old[d].splitlines(True), new[d].splitlines(True),
                                                       str(d), "regenerated from bench/results/"))
            print(f"\n{d} differs from its raw files: run `moe-serve bench tables`", file=sys.stderr)
        if changed:
            return 1
        print(f"{', '.join(d.name for d in a.docs)}: {len(REGISTRY)} blocks match their raw files")
        return 0
    for d in changed:
        d.write_text(new[d])
    print(f"{', '.join(d.name for d in a.docs)}: {len(REGISTRY)} blocks written")
    return 0
