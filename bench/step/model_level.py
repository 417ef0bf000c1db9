"""Model level: the decode step per switch set, one warm server process each, through the yardstick.

Each switch set is a yardstick variant (moe_serve.bench.serve.servers: `moe-serve+<setting>` turns a decode
path setting of the plugin's config on, `<server>+<tweak>` changes one vLLM attention setting), run
at c = 1 as the weights route, one process per variant, profiled (vLLM's torch profiler: the step
per kernel class and GPU idle). From its records: ITL p50 per variant, the ratio to `moe-serve` as
shipped, launches per decode step (kernels and copies in the profile, long burst minus short over
the token difference), how many kernel names a set ran that moe-serve did not and the reverse (none:
the switch changed no kernel) and the step budget slice by slice (moe_serve.bench.serve.render.step_budget: measured
ms and the slice's byte floor).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

DEFAULT_SETS = ("vllm-serve", "moe-serve", "moe-serve+fused", "moe-serve+fa3-one-split")


def yardstick_argv(model: str, out: Path, sets: tuple[str, ...], budget_s: float, extra: list[str]) -> list[str]:
    """The yardstick call that measures the sets: c = 1, one process each, profiled at c = 1."""
    return ["--model", model, "--out", str(out), "--variants", ",".join(sets), "--concurrency", "1",
            "--processes", "1", "--frontend-every", "1000000", "--profile", "--profile-levels", "1",
            "--budget-s", f"{budget_s:.0f}", *extra]


def launches_per_step(profile_level: dict[str, Any]) -> float:
    """Kernel launches and copies per decode step in one profiled level (long minus short)."""
    (s, l) = profile_level["tokens"]
    count = {k: sum(c for c, _ in profile_level[k]["kernels"].values()) for k in ("short", "long")}
    return (count["long"] - count["short"]) / (l - s)


def kernel_names(profile_level: dict[str, Any]) -> set[str]:
    """The names of the kernels (and copies) one profiled level ran, both bursts."""
    return {name for k in ("short", "long") for name in profile_level[k]["kernels"]}


def summary(out: Path) -> list[dict[str, Any]]:
    """Per variant: the median over its processes of ITL p50 ms at c = 1, its ratio to moe-serve as
    shipped, launches per step and the kernel names it ran (from its profiled process), processes;
    "kernels_changed": (names new, names gone) against moe-serve's, so that a switch set that ran
    the same kernels (a switch that took no layer) shows it."""
    from moe_serve.bench.serve import stats as serve_stats

    itl: dict[str, list[float]] = {}
    launches: dict[str, float] = {}
    names: dict[str, set[str]] = {}
    for p in serve_stats.load([out]):
        cell = p.cells.get(1, {})
        if cell.get("errors", 1) or "itl_p50_ms" not in cell:
            continue
        itl.setdefault(p.variant, []).append(cell["itl_p50_ms"])
        prof = ((p.meta.get("profile") or {}).get("levels") or {}).get("1")
        if prof:
            launches[p.variant] = launches_per_step(prof)
            names[p.variant] = kernel_names(prof)
    rows = {v: {"variant": v, "itl_p50_ms": statistics.median(ts), "processes": len(ts),
                "launches_per_step": launches.get(v)} for v, ts in itl.items()}
    base = rows.get("moe-serve", {}).get("itl_p50_ms")
    shipped = names.get("moe-serve")
    for v, r in rows.items():
        r["vs_moe_serve"] = base / r["itl_p50_ms"] if base else None
        r["kernels_changed"] = ((len(names[v] - shipped), len(shipped - names[v]))
                                if shipped is not None and v in names and v != "moe-serve" else None)
    return sorted(rows.values(), key=lambda r: r["itl_p50_ms"])


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| switch set | processes | ITL p50 ms (c = 1) | speedup vs moe-serve as shipped | launches / step "
           "| kernels new / gone vs moe-serve |",
           "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = f"{r['vs_moe_serve']:.3f}" if r["vs_moe_serve"] else "—"
        launches = f"{r['launches_per_step']:.0f}" if r["launches_per_step"] is not None else "—"
        changed = r.get("kernels_changed")
        diff = "—" if changed is None else ("none: the same kernels" if changed == (0, 0) else
                                            f"{changed[0]} / {changed[1]}")
        out.append(f"| {r['variant']} | {r['processes']} | {r['itl_p50_ms']:.3f} | {ratio} | {launches} | {diff} |")
    return "\n".join(out)
