"""Markdown for HISTORY.md's 2026-12-01 kernel sections (decode path, floor, tuner), computed
from the raw files (bench/results_tables.py's registry calls these)."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

NAN = float("nan")


def _rows(path: Path, part: str = "bench") -> list[dict]:
    return json.loads(path.read_text())[part]


def _geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else NAN


def _f(v: float | None, nd: int = 2) -> str:
    return "" if v is None or v != v else f"{v:.{nd}f}"


def floor_table(path: Path, max_m: int = 64) -> list[str]:
    """Per cell at M <= max_m: ours, vLLM, floor (µs), speed-up, both / floor, route, config."""
    out = ["| shape | dtype | M | ours µs | vLLM µs | floor µs | speed-up | ours / floor | "
           "vLLM / floor | served by | our config |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in _rows(path):
        if r["M"] > max_m or "ours_us" not in r:
            continue
        out.append(f"| {r['shape']} | {r['dtype']} | {r['M']} | {_f(r['ours_us'], 1)} | "
                   f"{_f(r.get('vllm_us'), 1)} | {_f(r.get('floor_us'), 1)} | {_f(r.get('speedup'))} | "
                   f"{_f(r.get('ours_vs_floor'))} | {_f(r.get('vllm_vs_floor'))} | {r['route']} | "
                   f"`{r['cfg']}` |")
    return out


def geomeans(*paths: Path) -> list[str]:
    """Per (shape, dtype) over all given runs' rows: geomean speed-up at M <= 64 against the
    issue's target (tuned: bf16 1.1x, fp8 1.5x; default config: 1.0x and no cell below 0.9x),
    worst cell, worst ours/floor at M <= 64, the served geomean at M <= 64 (ours where the
    run's routing sent the cell, else vLLM's kernel) and the served minimum over every M."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for p in paths:
        for r in _rows(p):
            if "speedup" in r:
                groups.setdefault((r["shape"], r["dtype"]), []).append(r)
    out = ["| shape | dtype | config | geomean M<=64 | target | min M<=64 | max ours/floor M<=64 | "
           "served geomean M<=64 | served min (all M) | cells |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (shape, dt), rs in groups.items():
        small = [r for r in rs if r["M"] <= 64]
        tuned = bool(rs[0].get("tuned"))
        target = (1.5 if dt == "fp8" else 1.1) if tuned else 1.0
        gm = _geomean([r["speedup"] for r in small])
        floors = [r["ours_vs_floor"] for r in small if "ours_vs_floor" in r]
        out.append(f"| {shape} | {dt} | {'tuned' if tuned else 'default'} | **{gm:.2f}x** | "
                   f"{target}x | {min(r['speedup'] for r in small):.2f}x | "
                   f"{max(floors) if floors else NAN:.2f} | "
                   f"{_geomean([r['served_speedup'] for r in small]):.2f}x | "
                   f"{min(r['served_speedup'] for r in rs):.2f}x | {len(rs)} |")
    return out


def served_below(*paths: Path, limit: float = 0.98) -> list[str]:
    """Cells where what serving runs (ours where routed, else vLLM's kernel) was below limit."""
    out = []
    for p in paths:
        for r in _rows(p):
            if r.get("served_speedup", 1.0) < limit:
                out.append(f"- {p.parent.name}/{p.name}: {r['shape']} {r['dtype']} M={r['M']}: "
                           f"{r['served_speedup']:.2f}x (routed {r['route']})")
    return out or [f"- none below {limit}x"]


def decode_sweep(path: Path) -> list[str]:
    """The 2026-12-01 sweep: per cell the best decode config's time against the floor and
    against our aligned path, plus the counts that set the default path rule."""
    cells = json.loads(path.read_text())["cells"]
    out = ["| shape | dtype | M | floor µs | aligned µs | best decode µs | decode / floor | "
           "aligned / decode | best decode config |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    rule_wins = rule_cells = 0
    for c in cells:
        gain = c["aligned_us"] / c["best_us"]
        out.append(f"| {c['shape']} | {c['dtype']} | {c['M']} | {c['floor_us']:.1f} | "
                   f"{c['aligned_us']:.1f} | {c['best_us']:.1f} | {c['best_us'] / c['floor_us']:.2f} | "
                   f"{gain:.2f} | `{c['best_cfg']}` |")
        if c["M"] * c["topk"] <= min(32, c["E"]):
            rule_cells += 1
            rule_wins += gain >= 1.0
    out += ["", f"Cells with M * topk <= min(32, E) (the default decode rule): the decode path was "
                f"at least as fast as the aligned path in {rule_wins} of {rule_cells}."]
    return out


def correctness(path: Path) -> list[str]:
    """GPU correctness: pass count and max relative error per variant family."""
    rows = json.loads(path.read_text())["correctness"]
    fam: dict[str, list[dict]] = {}
    for r in rows:
        fam.setdefault(f"{r['swap']} / {r['variant'].split(' ')[0]}", []).append(r)
    out = [f"{sum(r['ok'] for r in rows)}/{len(rows)} PASS.", "",
           "| path / variant | pass | max ‖out−ref‖/‖ref‖ | failures |", "|---|---:|---:|---|"]
    for k, rs in fam.items():
        errs = [r["rel_err"] for r in rs if r["rel_err"] == r["rel_err"]]
        bad = "; ".join(f"{r['shape']} M={r['M']} {r['variant']}" for r in rs if not r["ok"])
        out.append(f"| {k} | {sum(r['ok'] for r in rs)}/{len(rs)} | "
                   f"{max(errs) if errs else NAN:.2e} | {bad} |")
    return out


def tune_times(*logs: Path) -> list[str]:
    """`moe-serve tune` wall time per model and dtype (TUNE_TIME lines of the session logs)."""
    out = ["| model | TP | dtype | wall time (process start to table written) |", "|---|---|---|---:|"]
    for log in logs:
        for m in re.finditer(r"^TUNE_TIME (\S+) tp(\d+) (\w+)(?: \S+)? (\d+)s$", log.read_text(), re.M):
            out.append(f"| {m[1]} | {m[2]} | {m[3]} | {m[4]} s |")
    return out


def prequant_grid(shape: str, dtype: str, rows_path: Path, bench_path: Path) -> list[str]:
    """Rows of a config grid timed per M (each {M, start, config, cfg, us}): the shipped config,
    the best config without and with A_PREQUANT (x quantized once before GEMM1), against vLLM's
    kernel and the floor measured by bench_kernels.py for the same cell in an earlier run."""
    grid = json.loads(rows_path.read_text())
    ref = {r["M"]: r for r in _rows(bench_path) if r["shape"] == shape and r["dtype"] == dtype}
    out = ["| M | configs timed | shipped µs | best without A_PREQUANT µs | best with A_PREQUANT µs | "
           "its config | vLLM µs (earlier run) | floor µs | best / vLLM |",
           "|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for m in sorted({r["M"] for r in grid}):
        rs = [r for r in grid if r["M"] == m and "us" in r]
        shipped = next(r["us"] for r in rs if r["start"] == "shipped")
        plain = min(r["us"] for r in rs if not r["config"].get("A_PREQUANT"))
        pq = min((r for r in rs if r["config"].get("A_PREQUANT")), key=lambda r: r["us"])
        v = ref.get(m, {})
        out.append(f"| {m} | {len(rs)} | {shipped:.1f} | {plain:.1f} | **{pq['us']:.1f}** | `{pq['cfg']}` | "
                   f"{_f(v.get('vllm_us'), 1)} | {_f(v.get('floor_us'), 1)} | "
                   f"{_f(pq['us'] / v['vllm_us'] if v.get('vllm_us') else None)} |")
    return out


def gemv_table(path: Path) -> list[str]:
    """bench_gemv.py: per shape, format and M, the GEMV decode path's best walked config against
    the tensor-core decode path as served, vLLM's fused_experts and the streaming floor (µs per
    layer call), with its checks."""
    rows = json.loads(path.read_text())["rows"]
    out = ["| shape | format | M | ours as configured µs (serving routes to) | GEMV µs | vLLM µs | floor µs | ours / GEMV | "
           "vLLM / GEMV | GEMV / floor | GEMV config | rel err vs float64 |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if "gemv_us" not in r:
            out.append(f"| {r['shape']} | {r['format']} | {r['M']} | error: {r.get('error', '')} |"
                       + " |" * 8)
            continue
        v = r.get("vllm_us")
        out.append(f"| {r['shape']} | {r['format']} | {r['M']} | {_f(r['served_us'], 1)} ({r['route']}) | "
                   f"{_f(r['gemv_us'], 1)} | {_f(v, 1)} | {_f(r['floor_us'], 1)} | "
                   f"{_f(r['served_us'] / r['gemv_us'])} | {_f(v / r['gemv_us']) if v else ''} | "
                   f"{_f(r['gemv_us'] / r['floor_us'])} | `{r['gemv_cfg']}` | {r['err_vs_f64']:.1e} |")
    return out


def prefetch_table(path: Path) -> list[str]:
    """bench_prefetch.py: per shape, format and M, the served decode config with the up kernel's
    L2 prefetch of the down weights off (as served), as it starts (pf1) and after its K loop
    (pf2), against vLLM's fused_experts and the streaming floor (µs per layer call), with checks."""
    rows = json.loads(path.read_text())["rows"]
    out = ["| shape | format | M | served config | pf0 µs | pf1 µs (pf0 / pf1) | pf2 µs (pf0 / pf2) | "
           "vLLM µs | floor µs | best / floor | rel err vs float64 (pf0, pf1, pf2) | equal to pf0 |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        head = f"| {r['shape']} | {r['format']} | {r['M']} | `{r.get('served_cfg', '')}` |"
        if "pf0_us" not in r:
            why = r.get("skipped") or f"error: {r.get('error', '')}"
            out.append(head + f" {why} |" + " |" * 7)
            continue
        best = min(r[f"pf{m}_us"] for m in (0, 1, 2))
        sp = {m: r["pf0_us"] / r[f"pf{m}_us"] for m in (1, 2)}
        cell = {m: f"{_f(r[f'pf{m}_us'], 1)} ({'**' if sp[m] > 1.01 else ''}{sp[m]:.3f}"
                   f"{'**' if sp[m] > 1.01 else ''})" for m in (1, 2)}
        errs = ", ".join(f"{r[f'err_vs_f64_pf{m}']:.1e}" for m in (0, 1, 2))
        floor, vllm = r.get("floor_us"), _f(r.get("vllm_us"), 1)
        if r.get("vllm_error") or r.get("error"):   # raised after ours were timed (vLLM's
            vllm = "raises"                             # kernel: older rows record it as error)
        out.append(head + f" {_f(r['pf0_us'], 1)} | {cell[1]} | {cell[2]} | {vllm} | "
                   f"{_f(floor, 1)} | {_f(best / floor) if floor else ''} | {errs} | "
                   f"{'yes' if r['bitwise_equal'] else 'no'} |")
    return out


def refined_tables(*paths: Path) -> list[str]:
    """`moe-serve tune --refine`: per refined table (its "refined" record), each bucket's config
    before and after and their µs per layer call."""
    out = ["| table | M | before µs | after µs | before / after | config after |",
           "|---|---:|---:|---:|---:|---|"]
    for p in sorted(paths):
        data = json.loads(p.read_text())
        name = f"{data.get('model', p.stem)} `{p.name.split(',device=')[0]}`"
        for b, r in sorted(data["refined"]["buckets"].items(), key=lambda kv: int(kv[0])):
            changed = r["before"] != r["after"]
            out.append(f"| {name} | {b} | {r['before_us']:.1f} | {r['after_us']:.1f} | "
                       f"{'**' if changed else ''}{r['before_us'] / r['after_us']:.3f}{'**' if changed else ''} | "
                       f"`{r['after']}`{'' if changed else ' (kept)'} |")
    return out
