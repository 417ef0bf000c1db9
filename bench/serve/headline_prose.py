"""The headline's sentences, generated from the same raw files as its table (headline.row_data).

Under the first-screen table of README.md and RESULTS.md: how a cell is measured and the bar it
must meet (the constants of schedule.py and moe_serve.bench.stats), then per row which MoE table `vllm serve`
ran, each cell that meets the bar, each that does not with what was measured and why it misses,
and for a row not measured yet the command that measures it. No number in them is typed by hand.
"""
from __future__ import annotations

from moe_serve.bench.serve.ab_tables import counts, ratio_text
from moe_serve.bench.serve.headline import Cell, HeadlineRow, RowData, model_format, row_data
from moe_serve.bench.serve.schedule import BATCHED, MIN_BATCHED_REQUESTS, MIN_PROCESSES, WIDE_PROCESSES
from moe_serve.bench.stats import WIDE

CELLS = (("c1", "c = 1 ITL speedup"), ("c8", "c = 8 tok/s ratio"), ("c64", "c = 64 tok/s ratio"))


def method(data: list[RowData]) -> str:
    """The paragraph on how a cell is measured and the bar it must meet."""
    versions = sorted({v for d in data for v in d.vllm})
    return ("Each measured row is moe-serve against `vllm serve` (vLLM " + ", ".join(versions) + ") on one GPU, both "
            "servers in alternating fresh processes with the same engine flags and dummy weights (`moe-serve bench "
            "serve`); a cell is the ratio of geometric means over processes with its 95 % Welch interval (**bold**: "
            "the lower bound is above 1), processes ours + `vllm serve`'s. A cell meets the bar with at least "
            f"{MIN_PROCESSES} + {MIN_PROCESSES} processes ({WIDE_PROCESSES} + {WIDE_PROCESSES} where its interval is "
            f"wider than {100 * WIDE:.0f} %) and, at c >= {BATCHED}, {MIN_BATCHED_REQUESTS} timed requests in every "
            "process; below it the table says n/a and why. % floor is the step at the byte floor (the weights and KV "
            "cache a step must read, over the measured copy ceiling) over the measured step.")


def cell_words(name: str, x: Cell) -> str | None:
    """One cell in words; None for a cell not measured."""
    if x.ratio is None:
        return None
    if x.met:
        return f"{name} {x.text}"
    return f"{name} measured {ratio_text(x.ratio)} ({counts(x.ratio)}){x.outliers}, below the bar: {x.reason}"


def row_sentence(d: RowData) -> str:
    """One row's sentence."""
    h = d.row
    what = f"**{h.model}** ({model_format(h.model)}) on one {d.gpu}"
    if not d.measured:
        return f"- {what}: not measured yet ({h.settings}; the table gives the command)."
    cells = [w for attr, name in CELLS if (w := cell_words(name, getattr(d, attr)))]
    met = sum(getattr(d, attr).met for attr, _ in CELLS)
    return (f"- {what} at {', '.join(d.commits)}, against `vllm serve` with MoE table: {d.baseline}. "
            f"{met} of {len(cells)} measured cells meet the bar: {'; '.join(cells)}.")


def prose(rows: list[HeadlineRow]) -> list[str]:
    """The headline's paragraphs (module docstring) for these rows, in their order."""
    data = [row_data(h) for h in rows]
    return [method([d for d in data if d.measured]), ""] + [row_sentence(d) for d in data]
