"""The headline's rows and cells: what the first screen of README.md and RESULTS.md may claim.

A `HeadlineRow` names a model on one GPU and its run directories as the weights route (c = 1) and
under realistic expert load (c = 8, 64). `row_data` computes its cells from the raw files, for the
table (render.headline) and the sentences (headline_prose.py) alike. A cell shows moe-serve's
ratio to `vllm serve` only where it meets the bar (schedule.py): at least 3 + 3 processes, 4 + 4
where the 95 % interval is wider than 2 %, and at c >= 8 at least 256 timed requests in every
process; else "n/a" with the reason. A process outside its variant's spread (spread.py) is named
in the cell with the ratio without it. The row also says which MoE table `vllm serve` ran
(baseline_table.row_label).
"""
from __future__ import annotations

import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from moe_serve.bench.model_dirs import model_config
from moe_serve.bench.serve import baseline_table, spread
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve.ab_tables import bold, counts, ratio_text
from moe_serve.bench.serve.schedule import BATCHED, MIN_BATCHED_REQUESTS, MIN_PROCESSES, processes_needed
from moe_serve.bench.serve.servers import ALL_VARIANTS, BASELINE, OURS
from moe_serve.bench.stats import WIDE

NOT_MEASURED = "not measured"
LAUNCHES = "moe_serve_moe_kernel_launches_total"   # the plugin's MoE launches by path (optimized = ours)


@dataclass(frozen=True)
class HeadlineRow:
    """One first-screen row: a model on one GPU, its run directories as the weights route (c = 1)
    and under realistic load (c = 8 and 64); either may be empty (a row not measured yet: `gpu`
    and the `command` that measures it)."""

    model: str
    weights_dirs: tuple[Path, ...] = ()
    uniform_dirs: tuple[Path, ...] = ()
    variant: str = OURS
    settings: str = "as shipped"          # how the measured engine differs from what ships, if it does
    baseline_table: str = "not recorded"  # `vllm serve`'s MoE table where the runs kept neither record nor log
    gpu: str = ""
    command: str = ""


@dataclass(frozen=True)
class Cell:
    """One headline cell: its text, the measured ratio and its pooled row, why it misses the bar."""

    text: str
    ratio: dict[str, Any] | None = None   # moe_serve.bench.stats.ratio_ci, where measured
    row: dict[str, Any] | None = None
    reason: str = ""                      # why it is n/a ("": it meets the bar)
    outliers: str = ""                    # outside_spread's note

    @property
    def met(self) -> bool:
        return self.ratio is not None and not self.reason


def shortfall(procs: list[serve_stats.Process], c: int, variant: str, ratio: dict[str, Any]) -> str:
    """Why a cell misses the bar (module docstring); "" where it meets it."""
    n, nb = ratio["n"], ratio["n_base"]
    if min(n, nb) < MIN_PROCESSES:
        return f"too few processes ({n} + {nb}; needs {MIN_PROCESSES} + {MIN_PROCESSES})"
    sent = [p.cells[c]["n_requests"] for p in procs if p.variant in (variant, BASELINE) and not p.cells[c]["errors"]]
    if c >= BATCHED and min(sent) < MIN_BATCHED_REQUESTS:
        return f"too few requests ({min(sent)} a process; needs {MIN_BATCHED_REQUESTS} at c >= {BATCHED})"
    need = processes_needed(ratio)
    if min(n, nb) < need:
        return (f"too few processes for its interval ({n} + {nb}: [{ratio['lo']:.3f}, {ratio['hi']:.3f}] is wider "
                f"than {100 * WIDE:.0f} %; needs {need} + {need})")
    return ""


def outside_spread(procs: list[serve_stats.Process], c: int, key: str, variant: str) -> str:
    """"; without vllm-serve r1 (outside its variant's spread): RATIO (n + m)" for each process
    of the variant or the baseline flagged at c in the cell's metric; "" where none is."""
    metric = next(m for m, k in spread.METRICS.items() if k == key)
    out = ""
    for f in spread.flags(procs):
        if f.level != c or f.metric != metric or f.variant not in (variant, BASELINE):
            continue
        for v, _, without in spread.with_and_without(procs, f, BASELINE, ALL_VARIANTS):
            if v == variant and without:
                out += f"; without {f.variant} r{f.round} (outside its variant's spread): {ratio_text(without)} ({counts(without)})"
    return out


def cell(procs: list[serve_stats.Process], c: int, key: str, variant: str) -> Cell:
    """The variant's ratio `key` at c against `vllm serve`, if it meets the bar."""
    rows = {(r["level"], r["variant"]): r for r in serve_stats.pooled_rows(procs, BASELINE, ALL_VARIANTS)} if procs else {}
    r, base = rows.get((c, variant)), rows.get((c, BASELINE))
    if not (r and base and r.get(key)):
        return Cell(NOT_MEASURED)
    ratio = r[key]
    reason, outliers = shortfall(procs, c, variant, ratio), outside_spread(procs, c, key, variant)
    if reason:
        return Cell(f"n/a: {reason}{outliers}", ratio, r, reason, outliers)
    return Cell(bold(ratio_text(ratio), ratio["lo"] > 1) + f" ({counts(ratio)}){outliers}", ratio, r, "", outliers)


def model_format(model: str) -> str:
    """The weight format of a bench model, from its config's quantization_config."""
    q = (model_config(model) or {}).get("quantization_config") or {}
    if not q:
        return "bf16"
    if q.get("quant_method") == "fp8":
        return "FP8 block" if q.get("weight_block_size") else f"FP8 per-tensor ({q.get('activation_scheme', 'dynamic')})"
    return "FP8-dynamic (per-channel)" if q.get("quant_method") == "compressed-tensors" else q.get("quant_method", "?")


def launches(d: Path) -> dict[str, float]:
    """{path: MoE kernel launches} a moe-serve process reported (moe_metrics.txt, or .xz as kept)."""
    for name in ("moe_metrics.txt", "moe_metrics.txt.xz"):
        if (d / name).is_file():
            data = (d / name).read_bytes()
            text = (lzma.decompress(data) if name.endswith(".xz") else data).decode()
            return {s.labels["path"]: s.value for fam in text_string_to_metric_families(text)
                    for s in fam.samples if s.name == LAUNCHES}
    return {}


def launch_share(procs: list[serve_stats.Process], variant: str) -> str:
    """"our kernel ran 4 % of the MoE launches (384 of 8,736 a process)": the variant's processes'
    launches by path, where they reported them; "" else."""
    counts = [launches(p.dir) for p in procs if p.variant == variant]
    counts = [c for c in counts if sum(c.values())]
    if not counts:
        return ""
    ours, total = (sum(c.get("optimized", 0) for c in counts) / len(counts),
                   sum(sum(c.values()) for c in counts) / len(counts))
    return f"our kernel ran {100 * ours / total:.0f} % of the MoE launches ({ours:,.0f} of {total:,.0f} a process)"


@dataclass(frozen=True)
class RowData:
    """A headline row computed from its raw files."""

    row: HeadlineRow
    gpu: str
    tp: int | None
    baseline: str                     # `vllm serve`'s MoE table, in words
    c1: Cell
    c8: Cell
    c64: Cell
    commits: tuple[str, ...]
    vllm: tuple[str, ...]             # the vLLM versions the processes ran
    launches: str                     # launch_share of the weights' runs

    @property
    def measured(self) -> bool:
        return any(x.text != NOT_MEASURED for x in (self.c1, self.c8, self.c64))


def row_data(h: HeadlineRow) -> RowData:
    """One row's cells, baseline, commits and versions (a row with no runs: every cell not measured)."""
    weights, uniform = serve_stats.load(list(h.weights_dirs)), serve_stats.load(list(h.uniform_dirs))
    procs = weights + uniform
    serve_stats.by_model(procs, BASELINE)
    base = [(p.dir, p.meta) for p in procs if p.variant == BASELINE]
    p0 = procs[0].meta if procs else {}
    return RowData(h, p0.get("gpu", h.gpu), p0["workload"]["engine"]["tensor_parallel_size"] if procs else None,
                   baseline_table.row_label(base, h.baseline_table) if base else "—",
                   cell(weights, 1, "itl_speedup", h.variant), cell(uniform, 8, "tok_s_ratio", h.variant),
                   cell(uniform, 64, "tok_s_ratio", h.variant),
                   tuple(sorted({(p.meta.get("commit") or "unknown")[:7] + ("+dirty" if p.meta.get("dirty") else "")
                                 for p in procs})),
                   tuple(sorted({p.meta["vllm"] for p in procs if p.meta.get("vllm")})), launch_share(weights, h.variant))
