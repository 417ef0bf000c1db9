"""Build the routing table (kernels/moe/routing.py) from `moe-serve bench kernels` results.json files and
the routing tables `moe-serve tune` writes (their measured points; a later tune of a shape
replaces every earlier point of that shape, since its tables changed).

    python -m moe_serve.kernels.tuning.make_routing bench/results/2026-12-02/.../bench_results.json \
        .../tuned/routing_mixtral-8x7b.json --device NVIDIA_H200 --triton-version 3.6.0

Per shape and measured M, s = vLLM's time / ours (> 1: ours faster). A run-to-run spread d
(in ln s) tells a real difference from noise:

- d is measured where the results repeat a cell (same shape, dtype, M and config in two or
  more files): the 90th percentile over those cells of ln(max s / min s), at least MIN_SPREAD,
  given MIN_REPEATS cells; else DEFAULT_SPREAD (0.03: on the H200, 2026-12-01, 180 cells
  measured twice with the same config differed by a median 0.6 %, 90th percentile 2.5 %).
- Hysteresis along M (ascending, starting from vLLM): a measured M flips the route to ours
  only when ln s >= d (or when vLLM's kernel raised there and ours ran: vLLM's block-FP8
  kernel cannot run N % 128 != 0), back to vLLM only when ln s <= -d or ours errored; inside the band
  (equal within noise) it keeps the route of the M below, so noise cannot split a range.
- Smoothing: a measured M whose route differs from its two measured neighbours, which agree,
  follows them unless |ln s| >= 2 d. A lone reading just outside the band is as likely noise
  as a change of regime (over ~20 points per shape, a 90th-percentile spread is exceeded about
  twice); one far outside it (a config that loses by more) stays.
- Between two measured M at most MAX_GAP (2x) apart: ours iff both are ours (a wider gap is
  vLLM: DeepSeek-V3 bf16 won at M=256 and 4096 and lost at 512). Below the smallest and above
  the largest measured M: vLLM, unless vLLM's kernel failed at that nearest measured M and ours
  ran (its failure is the shape's, not the M's), and likewise between two such points.

Repeated readings of a cell with the config of its last file are averaged (geometric mean).
Bench rows whose shape moe_serve.kernels.tuning.named_shapes does not name are skipped; shapes never measured
are absent (they take the default rule: moe_serve.kernels.moe.routing.default_ranges). Each point keeps
its measured config string (a test checks the configs routed to ours are still the measured
ones), its route and the reason for it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from moe_serve.kernels.tuning.named_shapes import TUNED, UNTUNED

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SPREAD = 0.03
MIN_SPREAD = 0.01
MIN_REPEATS = 8
MAX_GAP = 2          # interpolate "ours" only between measured M at most 2x apart
OURS, VLLM = "ours", "vllm"
RULE = ("hysteresis over measured M: ours after ln(vLLM time / ours) >= spread or where only "
        "vLLM's kernel failed, vLLM after <= -spread or an error, else the route of the M below; "
        "a lone flip within 2x the spread follows its neighbours; "
        "between measured M at most 2x apart ours iff both are; "
        "unmeasured M outside them: vllm, or ours beside a point where only vLLM's kernel failed")


def decide_points(points: dict[int, float | None], spread: float = DEFAULT_SPREAD) -> dict[int, tuple[str, str]]:
    """points {M: s or None (error)} -> {M: (backend, why)} (see the module doc)."""
    out: dict[int, tuple[str, str]] = {}
    state = VLLM
    for m in sorted(points):
        s = points[m]
        if s is None:
            state, why = VLLM, "error (ours), or vLLM not timed: vLLM"
        elif s == math.inf:
            state, why = OURS, "vLLM's kernel failed here and ours ran: ours"
        elif math.log(s) >= spread:
            state, why = OURS, f"{s:.3f}x: ours faster beyond the spread ({math.exp(spread):.3f}x)"
        elif math.log(s) <= -spread:
            state, why = VLLM, f"{s:.3f}x: vLLM faster beyond the spread ({math.exp(-spread):.3f}x)"
        else:
            why = f"{s:.3f}x: within the spread, keeps the route below ({state})"
        out[m] = (state, why)
    ms = sorted(points)
    for i in range(1, len(ms) - 1):
        lo, m, hi = out[ms[i - 1]][0], out[ms[i]][0], out[ms[i + 1]][0]
        s = points[ms[i]]
        if lo == hi != m and s is not None and abs(math.log(s)) < 2 * spread:
            out[ms[i]] = (lo, f"{s:.3f}x: a lone flip within 2x the spread, follows its neighbours ({lo})")
    return out


def build_ranges(points: dict[int, float | None], spread: float = DEFAULT_SPREAD) -> list[dict]:
    """points {M: s or None (error)} -> merged [{m_min, m_max, backend}] covering 1.."""
    dec = {m: b for m, (b, _) in decide_points(points, spread).items()}
    ms = sorted(points)
    only_ours = {m for m in ms if points[m] == math.inf}      # vLLM's kernel failed, ours ran
    raw: list[tuple[int, int | None, str]] = []
    if ms and ms[0] > 1:
        raw.append((1, ms[0] - 1, OURS if ms[0] in only_ours else VLLM))
    for i, m in enumerate(ms):
        raw.append((m, m, dec[m]))
        if i + 1 < len(ms) and ms[i + 1] > m + 1:
            both = dec[m] == OURS == dec[ms[i + 1]] and (ms[i + 1] <= MAX_GAP * m
                                                         or {m, ms[i + 1]} <= only_ours)
            raw.append((m + 1, ms[i + 1] - 1, OURS if both else VLLM))
    raw.append(((ms[-1] + 1) if ms else 1, None, OURS if ms and ms[-1] in only_ours else VLLM))
    merged: list[dict] = []
    for lo, hi, b in raw:
        if merged and merged[-1]["backend"] == b and merged[-1]["m_max"] is not None \
                and merged[-1]["m_max"] + 1 == lo:
            merged[-1]["m_max"] = hi
        else:
            merged.append({"m_min": lo, "m_max": hi, "backend": b})
    return merged


def route_measured(measured: dict[str, dict[str, Any]], spread: float = DEFAULT_SPREAD) -> list[dict]:
    """Set "route" and "why" on each measured point {str(M): {"speedup", ...}}; the ranges."""
    points = {int(m): math.inf if p.get("vllm_error") and p.get("ours_us") and not p.get("error")
              else p.get("speedup") for m, p in measured.items()}
    for m, (backend, why) in decide_points(points, spread).items():
        measured[str(m)].update(route=backend, why=why)
    return build_ranges(points, spread)


def measured_spread(cells: dict[tuple, list[float]]) -> tuple[float, str]:
    """(spread, where it came from) from repeated cells {(shape, M, cfg): [s, ...]}."""
    reps = sorted(math.log(max(v) / min(v)) for v in cells.values() if len(v) > 1)
    if len(reps) < MIN_REPEATS:
        return DEFAULT_SPREAD, f"default ({len(reps)} repeated cells, fewer than {MIN_REPEATS})"
    p90 = reps[min(len(reps) - 1, int(0.9 * len(reps)))]
    return round(max(MIN_SPREAD, p90), 4), f"measured: 90th percentile over {len(reps)} repeated cells"


def _readings(results: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict[int, list[dict]]]]:
    """({shape key: {name, topk}}, {shape key: {M: readings in file order}}) of bench results
    and tune routing tables (a tune table's shape drops the shape's earlier readings)."""
    from moe_serve.kernels.moe.routing import shape_key

    shapes = {**TUNED, **UNTUNED}
    info: dict[str, dict] = {}
    rows: dict[str, dict[int, list[dict]]] = {}
    for res in results:
        if "shapes" in res:                                  # a `moe-serve tune` routing table
            for key, ent in res["shapes"].items():
                info[key] = {"name": ent["name"], "topk": ent["topk"]}
                rows[key] = {int(m): [{**v, "part": "tune"}] for m, v in ent.get("measured", {}).items()}
            continue
        for part, part_rows in res.items():
            for r in part_rows if isinstance(part_rows, list) else []:
                if isinstance(r, dict) and r.get("shape") in shapes:
                    E, N, K, topk = shapes[r["shape"]]
                    key = shape_key(E, N, K, r["dtype"])
                    info.setdefault(key, {"name": r["shape"], "topk": topk})
                    rows.setdefault(key, {}).setdefault(r["M"], []).append({**r, "part": part})
    return info, rows


def build(results: list[dict[str, Any]], device: str, sources: list[str], triton_version: str,
          spread: float | None = None) -> dict[str, Any]:
    """The routing table of results (in file order: a later file's reading of a cell wins)."""
    info, rows = _readings(results)
    cells: dict[tuple, list[float]] = {}
    for key, by_m in rows.items():
        for M, rs in by_m.items():
            for r in rs:
                if _speedup(r) is not None:
                    cells.setdefault((key, M, r.get("cfg")), []).append(_speedup(r))
    measured_d, spread_from = measured_spread(cells)
    d = measured_d if spread is None else spread
    acc: dict[str, dict[str, Any]] = {}
    for key, by_m in rows.items():
        ent = acc[key] = {**info[key], "measured": {}}
        for M, rs in sorted(by_m.items()):
            last = rs[-1]
            same = [_speedup(r) for r in rs if r.get("cfg") == last.get("cfg") and _speedup(r) is not None]
            sp = math.exp(sum(map(math.log, same)) / len(same)) if same and _speedup(last) is not None else None
            ent["measured"][str(M)] = {
                "speedup": None if sp is None else round(sp, 4), "readings": len(same) or 1,
                "ours_us": last.get("ours_us"), "vllm_us": last.get("vllm_us"), "cfg": last.get("cfg"),
                "error": (last.get("error") or "")[:80] or None, "part": last["part"]}
            if last.get("vllm_error"):
                ent["measured"][str(M)]["vllm_error"] = last["vllm_error"][:80]
        ent["ranges"] = route_measured(ent["measured"], d)
    return {"device": device, "triton_version": triton_version, "spread": d,
            "spread_from": spread_from if spread is None else "given", "sources": sources,
            "rule": RULE, "shapes": dict(sorted(acc.items()))}


def _speedup(row: dict[str, Any]) -> float | None:
    sp = row.get("speedup")
    return None if sp is None or sp != sp or sp <= 0 else float(sp)


def main(argv: list[str] | None = None) -> int:
    from moe_serve.kernels.moe import configs, routing

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+",
                    help="`moe-serve bench kernels` results.json files or `moe-serve tune` routing tables")
    ap.add_argument("--device", default="NVIDIA_H200")
    ap.add_argument("--triton-version", default=None,
                    help="the Triton the results were measured with (default: this one)")
    ap.add_argument("--out", default=str(configs.CONFIG_DIR))
    ap.add_argument("--spread", type=float, default=None,
                    help="run-to-run spread in ln(ratio) (default: measured, else 0.03)")
    args = ap.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.results]
    srcs = []
    for p in args.results:
        try:
            srcs.append(str(Path(p).resolve().relative_to(ROOT)))
        except ValueError:
            srcs.append(str(p))
    version = args.triton_version or configs.running_triton_version()
    table = build(results, args.device, srcs, version, args.spread)
    out = Path(args.out) / routing.file_name(args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    for key, ent in table["shapes"].items():
        print(f"{ent['name']:22s} {key:36s} {routing.format_ranges(ent['ranges'])}")
    print(f"spread {table['spread']} ({table['spread_from']}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
