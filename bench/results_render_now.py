"""RESULTS.md's opening (the current answer) and the README's headline, computed from the newest
raw files: the decode A/B ratios with their intervals, ours vs vLLM's kernel vs the memory floor
per MoE shape, and the tuner's wall times (bench/results_tables.py's registry calls these)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # kernels.moe.router_topk, for the router's limit
import decode_stats  # noqa: E402
from results_archive import RAW, ArchivePath  # noqa: E402
from results_render_kernels import _geomean as _gm  # noqa: E402
from results_render_kernels import _rows  # noqa: E402

WORKLOADS = {("distinct", 1.0): "distinct sequences", ("same", 0.0): "identical sequences"}


def rel(p: Path | ArchivePath) -> str:
    """A raw path as it is named under bench/results/ (archive members included); other paths whole."""
    if isinstance(p, ArchivePath):
        return str(p.inner)
    return p.relative_to(RAW).as_posix() if p.is_relative_to(RAW) else str(p)


def _x(v: float | None, nd: int = 2) -> str:
    return "n/a" if v is None or v != v else f"{v:.{nd}f}"


# --- decode A/B --------------------------------------------------------------------------------

def _decode_cells(variant: str, baseline: str, dirs: tuple) -> tuple[dict[str, dict], dict]:
    """B -> decode_stats row of variant / baseline over the runs in dirs, and one run (for its labels)."""
    runs = decode_stats.load_runs(list(dirs))
    rows = decode_stats.summarize(runs, baseline)
    return {r["B"]: r for r in rows if r["variant"] == variant}, runs[0]


def _ci_cell(r: dict | None) -> str:
    """'ratio [lo, hi]', the ratio in bold where the whole interval lies above 1."""
    if r is None:
        return "n/a"
    ratio = f"{r['ratio']:.3f}"
    if r["lo"] is None:
        return f"{ratio} (one process)"
    return (f"**{ratio}**" if r["lo"] > 1 else ratio) + f" [{r['lo']:.3f}, {r['hi']:.3f}]"


def decode_ab_summary(comparisons: tuple[tuple[str, str], ...], *groups: tuple) -> list[str]:
    """One row per (variant, baseline) comparison over its run dirs: the decode tok/s ratio and
    its 95 % interval over processes per batch size B and over all B (bench/decode_stats.py)."""
    cells = [_decode_cells(v, b, dirs) for (v, b), dirs in zip(comparisons, groups)]
    bs = sorted({b for c, _ in cells for b in c if b.isdigit()}, key=int)
    out = ["| model (dummy weights) | batches | ratio | " + " | ".join(f"B = {b}" for b in bs)
           + " | all B | processes |", "|---|---|---|" + "---:|" * (len(bs) + 1) + "---|"]
    for (variant, baseline), (c, run) in zip(comparisons, cells):
        model = PurePosixPath(run["model"]).name
        workload = WORKLOADS.get(decode_stats.workload(run), str(decode_stats.workload(run)))
        n = c.get("all")
        procs = f"{n['n']} / {n['n_base']}" if n else "n/a"
        out.append(f"| `{model}` | {workload} | {variant} / {baseline} | "
                   + " | ".join(_ci_cell(c.get(b)) for b in bs) + f" | {_ci_cell(n)} | {procs} |")
    return out


# --- kernels per shape ----------------------------------------------------------------------------

def _newest_rows(paths: tuple) -> tuple[dict[tuple[str, str], list[dict]], dict[str, list[str]]]:
    """(shape, dtype) -> rows of the last file that measured it; file -> the shapes it supplied."""
    rows: dict[tuple[str, str], list[dict]] = {}
    source: dict[tuple[str, str], str] = {}
    for p in paths:
        mine: dict[tuple[str, str], list[dict]] = {}
        for r in _rows(p):
            mine.setdefault((r["shape"], r["dtype"]), []).append(r)
        rows.update(mine)
        source.update({k: rel(p) for k in mine})
    by_file: dict[str, list[str]] = {}
    for f in map(rel, paths):
        shapes = list(dict.fromkeys(shape for (shape, _), src in source.items() if src == f))
        if shapes:
            by_file[f] = shapes
    return rows, by_file


def _at(rows: list[dict], m: int, key: str) -> float | None:
    return next((r.get(key) for r in rows if r["M"] == m), None)


def _shape_cells(rows: list[dict]) -> list[str]:
    """One dtype's cells: ours / vLLM (M <= 64 geomean, M = 1), served / vLLM (M <= 64), ours and
    vLLM over the floor (M <= 64 geomean, M = 1 each)."""
    rs = [r for r in rows if "speedup" in r]
    small = [r for r in rs if r["M"] <= 64]
    return [_x(_gm([r["speedup"] for r in small])), _x(_at(rs, 1, "speedup")),
            _x(_gm([r["served_speedup"] for r in small])),
            _x(_gm([r["ours_vs_floor"] for r in small])), _x(_at(rs, 1, "ours_vs_floor")),
            _x(_gm([r["vllm_vs_floor"] for r in small])), _x(_at(rs, 1, "vllm_vs_floor"))]


def kernel_shapes(*paths: Path) -> list[str]:
    """Per MoE shape, each cell 'bf16 / fp8', from the newest bench_kernels.py run that measured
    the shape: ours over vLLM's kernel (speed-up), as served (routing picks per M), and both
    against the streaming floor for the same bytes (time / floor time: 1.00 is the floor), each
    as the geomean over M <= 64 and at M = 1. Tuned shapes (a shipped table) first."""
    rows, by_file = _newest_rows(paths)
    shapes = sorted(dict.fromkeys(s for s, _ in rows), key=lambda s: not any(
        rs[0].get("tuned") for (s2, _), rs in rows.items() if s2 == s))
    dtypes = sorted({dt for _, dt in rows})
    out = [f"| shape | tuned table | ours / vLLM, M ≤ 64 | M = 1 | served / vLLM, M ≤ 64 | ours / floor, M ≤ 64 | "
           f"M = 1 | vLLM / floor, M ≤ 64 | M = 1 |", "|---|---|" + "---:|" * 7]
    groups: dict[tuple[bool, str], list[float]] = {}
    for shape in shapes:
        per = {dt: rows[(shape, dt)] for dt in dtypes if (shape, dt) in rows}
        tables = " / ".join(dict.fromkeys("yes" if rs[0].get("tuned") else "no" for rs in per.values()))
        cells = list(zip(*(_shape_cells(rs) for rs in per.values())))
        out.append(f"| {shape} | {tables} | " + " | ".join(" / ".join(c) for c in cells) + " |")
        for dt, rs in per.items():
            gm = _gm([r["speedup"] for r in rs if "speedup" in r and r["M"] <= 64])
            groups.setdefault((bool(rs[0].get("tuned")), dt), []).append(gm)
    summary = "; ".join(f"{'tuned' if t else 'no table'} {dt} **{_gm(v):.2f}x** ({len(v)} shapes)"
                        for (t, dt), v in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1])))
    served = [(r["served_speedup"], k, r["M"]) for k, rs in rows.items() for r in rs if "served_speedup" in r]
    low, (shape, dt), m = min(served)
    files = ", ".join(f"`{f}` ({len(s)} shapes)" for f, s in by_file.items())
    return out + ["", f"Each cell {' / '.join(dtypes)}. Ours / vLLM, geomean over shapes of the M ≤ 64 geomeans: "
                      f"{summary}. Lowest served cell at any M: {low:.2f}x ({shape} {dt} M = {m}). "
                      f"Raw, the newest run of each shape: {files}."]


# --- tune times -------------------------------------------------------------------------------

_TUNED = re.compile(r"^\[tune\] (\S+?)/TP(\d+) .* (\w+): tuned in \d+s; vs vLLM M=1 (\S+),", re.M)
_TIME = re.compile(r"^TUNE_TIME (\S+) tp(\d+) (\w+)(?: (\S+))? (\d+)s$", re.M)


def tune_times_now(*logs: Path) -> list[str]:
    """`moe-serve tune` wall time (process start to tables written) per model, TP and dtype, the
    newest log winning, and whether the tuner timed vLLM (its search then starts from vLLM's
    config and it writes the routing from measured ratios) or not (`vs vLLM ... n/a` in its log)."""
    cell: dict[tuple[str, str], dict[str, str]] = {}
    vllm: dict[tuple[str, str], set[str]] = {}
    for log in logs:
        text = log.read_text()
        timed = {(m[1], m[2], m[3]): m[4] != "n/a" for m in _TUNED.finditer(text)}
        for m in _TIME.finditer(text):
            if m[4] == "--no-vllm":          # the search-only phase of a two-phase run: not a whole tune
                continue
            key = (m[1], m[2])
            cell.setdefault(key, {})[m[3]] = f"{m[5]} s"
            vllm.setdefault(key, set()).add({True: "yes", False: "no"}.get(timed.get((m[1], m[2], m[3])), "n/a"))
    out = ["| model | TP | bf16 | fp8 | vLLM timed |", "|---|---:|---:|---:|---|"]
    for key, c in cell.items():
        out.append(f"| {key[0]} | {key[1]} | {c.get('bf16', 'n/a')} | {c.get('fp8', 'n/a')} | "
                   f"{', '.join(sorted(vllm[key]))} |")
    return out + ["", "Raw: " + ", ".join(f"`{rel(log)}`" for log in logs) + "."]


# --- the README's headline -------------------------------------------------------------------

def headline(fp8: tuple, bf16: tuple, *kernels: Path) -> list[str]:
    """Three lines for the README: the FP8 and bf16 decode A/B over all B, and the per-shape
    kernel geomeans summarized over tuned shapes."""
    f_all, f_run = _decode_cells("moe-serve", "stock", fp8)
    b_all, b_run = _decode_cells("moe-serve", "stock", bf16)
    rows, _ = _newest_rows(kernels)
    tuned: dict[str, list[float]] = {}
    for (_, dt), rs in rows.items():
        if rs[0].get("tuned"):
            tuned.setdefault(dt, []).append(_gm([r["speedup"] for r in rs if "speedup" in r and r["M"] <= 64]))
    kern = ", ".join(f"{dt} {_gm(v):.2f}x ({min(v):.2f}-{max(v):.2f}x over {len(v)} shapes)"
                     for dt, v in sorted(tuned.items()))

    def decode(c: dict, run: dict) -> str:
        wl = WORKLOADS.get(decode_stats.workload(run), "")
        bs = ", ".join(sorted((b for b in c if b.isdigit()), key=int))
        return f"{_ci_cell(c['all'])} over B = {bs} ({wl}, {c['all']['n']} processes per variant)"

    return [f"- Decode throughput, FP8 (`{PurePosixPath(f_run['model']).name}`): {decode(f_all, f_run)}; "
            f"bf16 (`{PurePosixPath(b_run['model']).name}`): {decode(b_all, b_run)}.",
            f"- The MoE layer alone, ours over vLLM's kernel, geomean M ≤ 64 on the tuned shapes: {kern}."]


# --- the router at decode ------------------------------------------------------------------------
def router_table(path: Path) -> list[str]:
    """bench/bench_router.py's rows: per router shape, vLLM's gate GEMM + top-k over our one launch
    at each M, and where the serving hook takes ours (kernels.moe.router_topk.max_tokens)."""
    from kernels.moe.router_topk import max_tokens    # imports Triton: only this block needs it

    rows = json.loads(path.read_text())["rows"]
    ms = sorted({r["M"] for r in rows})
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    out = ["| router (E x K, top-k, scoring) | " + " | ".join(f"M = {m}" for m in ms) + " | ours served up to M |",
           "|---|" + "---:|" * (len(ms) + 1)]
    for name in shapes:
        by_m = {r["M"]: r for r in rows if r["shape"] == name}
        r0 = next(iter(by_m.values()))
        cells = [f"{by_m[m]['vllm_us']:.2f} / {by_m[m]['ours_us']:.2f} = "
                 + (f"**{by_m[m]['speedup']:.2f}**" if by_m[m]["speedup"] > 1 else f"{by_m[m]['speedup']:.2f}")
                 if m in by_m else "" for m in ms]
        out.append(f"| {name} ({r0['E']} x {r0['K']}, {r0['topk']}, {r0['scoring']}"
                   + (" + bias" if r0["bias"] else "") + ") | " + " | ".join(cells)
                   + f" | {max_tokens(r0['E'], r0['K'])} |")
    return out + ["", f"Cells: vLLM µs / ours µs = vLLM's time over ours (**bold**: ours faster); CUDA-graph "
                      f"replays, {rel(path)}."]


def moe_block_table(path: Path) -> list[str]:
    """bench/bench_moe_block.py's rows: per block shape and M, vLLM's router + fused_experts against
    ours in each launch pattern the file timed (µs per MoE block, CUDA-graph replays) and the
    checks behind them. Files from before the block PDL switch timed two patterns of ours:
    `ours` (the block chained, served then) and `ours_pdl_off`; later files add the default (the
    down kernel alone a dependent launch)."""
    rows = json.loads(path.read_text())["rows"]
    chained = "ours_block_pdl_us" if "ours_block_pdl_us" in rows[0] else "ours_us"
    default = "ours_us" if chained != "ours_us" else None
    cols = [("vllm_us", "vLLM")] + ([(default, "ours, default")] if default else []) \
        + [(chained, "ours, block chained"), ("ours_pdl_off_us", "ours, no PDL")]
    out = ["| block (E, N, K, top-k, scoring) | M | " + " | ".join(f"{t} µs" for _, t in cols)
           + " | vLLM / ours as served | chained / no PDL | checks: experts rel err, replay rel err |",
           "|---|---:|" + "---:|" * (len(cols) + 2) + "---|"]
    for r in rows:
        sp = r["vllm_us"] / r[default or chained]        # the pattern the file's commit served
        gain = r["ours_pdl_off_us"] / r[chained]
        out.append(f"| {r['shape']} ({r['E']}, {r['N']}, {r['K']}, {r['topk']}, {r['scoring']}) | {r['M']} | "
                   + " | ".join(f"{r[k]:.2f}" for k, _ in cols)
                   + f" | {'**' if sp > 1 else ''}{sp:.2f}{'**' if sp > 1 else ''} | {gain:.3f} | "
                   f"{r['experts_rel_err_vs_vllm']:.4f}, {r['replay_rel_err_vs_eager']:.1e} |")
    return out + ["", f"Medians of {len(rows[0]['rounds_us']['vllm'])} alternating rounds; every row first "
                      f"checked: routing against vLLM's, experts against vLLM's fused_experts on our routing, "
                      f"{rows[0]['replays_checked']} CUDA-graph replays into NaN-poisoned outputs against the "
                      f"eager block; {rel(path)}."]


def attention_table(path: Path) -> list[str]:
    """bench/bench_attention.py's rows: vLLM's two Hopper attention backends per layer (cache
    write + attention, µs, CUDA-graph replays with L2 flushed), decode at batch B and context L,
    and prefill of one L-token prompt."""
    rows = json.loads(path.read_text())["rows"]
    out = ["| attention (heads / KV heads) | phase | B | context | FA3 µs (vLLM's default) | FA3, one split µs "
           "| Triton unified µs | FA3 / Triton |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        one = f"{r['fa3_1split_us']:.2f}" if "fa3_1split_us" in r else "—"
        ratio = r["triton_over_fa3"]
        out.append(f"| {r['shape']} ({r['heads']} / {r['kv_heads']}) | {r['phase']} | {r['B']} | {r['context']} | "
                   f"{r['fa3_us']:.2f} | {one} | {r['triton_us']:.2f} | "
                   f"{'**' if ratio > 1 else ''}{ratio:.2f}{'**' if ratio > 1 else ''} |")
    worst = max(max(r["fa3_err"], r["triton_err"]) for r in rows)
    return out + ["", f"Every row first checked: both backends' outputs, written into NaN-poisoned buffers, "
                      f"against an fp32 reference (max abs error {worst:.4f}) and against each other; "
                      f"{rel(path)}."]
