"""Build the routing table (kernels/moe/routing.py) from bench_kernels results.json files and
the routing tables `moe-serve tune` writes (their measured points; a later tune of a shape
replaces every earlier point of that shape, since its tables changed).

    python -m kernels.tuning.make_routing bench/results/2026-11-29/kernels_quick_bench_tuned.json \
        bench/results/2026-11-29/kernels_untuned.json --device NVIDIA_H200

Rule (conservative): at a measured M, "ours" iff our speed-up over vLLM's fused_experts is
>= THRESHOLD (1.02: beyond run-to-run noise of graph-replay medians); strictly between two
adjacent measured M at most MAX_GAP (2x) apart, "ours" iff BOTH neighbours are >= THRESHOLD
(a wider gap is "vllm": DeepSeek-V3 bf16 won at M=256 and 4096 and lost at 512); above the largest measured
M, and for rows that errored (no speed-up), "vllm". Shapes never measured are absent: they
route to vLLM (kernels.moe.routing). The measured config string of each point is kept, so a test
can check that the configs routed to ours are still the ones that were measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
THRESHOLD = 1.02
MAX_GAP = 2          # interpolate "ours" only between measured M at most 2x apart


def shape_table() -> dict[str, tuple[int, int, int, int]]:
    sys.path.insert(0, str(ROOT / "bench"))
    from shapes import TUNED, UNTUNED  # noqa: PLC0415

    return {**TUNED, **UNTUNED}


def build_ranges(points: dict[int, float | None], threshold: float = THRESHOLD) -> list[dict]:
    """points {M: speed-up or None (error)} -> merged [{m_min, m_max, backend}] covering 1.."""
    ms = sorted(points)
    win = {m: (points[m] is not None and points[m] >= threshold) for m in ms}
    raw: list[tuple[int, int | None, str]] = []
    if ms and ms[0] > 1:
        raw.append((1, ms[0] - 1, "vllm"))
    for i, m in enumerate(ms):
        raw.append((m, m, "ours" if win[m] else "vllm"))
        if i + 1 < len(ms) and ms[i + 1] > m + 1:
            both = win[m] and win[ms[i + 1]] and ms[i + 1] <= MAX_GAP * m
            raw.append((m + 1, ms[i + 1] - 1, "ours" if both else "vllm"))
    raw.append(((ms[-1] + 1) if ms else 1, None, "vllm"))
    merged: list[dict] = []
    for lo, hi, b in raw:
        if merged and merged[-1]["backend"] == b and merged[-1]["m_max"] is not None \
                and merged[-1]["m_max"] + 1 == lo:
            merged[-1]["m_max"] = hi
        else:
            merged.append({"m_min": lo, "m_max": hi, "backend": b})
    return merged


def build(results: list[dict[str, Any]], device: str, sources: list[str],
          threshold: float = THRESHOLD) -> dict[str, Any]:
    from kernels.moe.routing import shape_key

    shapes = shape_table()
    acc: dict[str, dict[str, Any]] = {}
    for res in results:
        if "shapes" in res:                                  # a `moe-serve tune` routing table
            for key, ent in res["shapes"].items():
                acc[key] = {"name": ent["name"], "topk": ent["topk"],
                            "measured": {m: {**v, "part": "tune"} for m, v in ent["measured"].items()}}
            continue
        for part, rows in res.items():
            if not isinstance(rows, list):
                continue
            for r in rows:
                if not isinstance(r, dict) or "shape" not in r or r["shape"] not in shapes:
                    continue
                E, N, K, topk = shapes[r["shape"]]
                key = shape_key(E, N, K, r["dtype"])
                ent = acc.setdefault(key, {"name": r["shape"], "topk": topk, "measured": {}})
                sp = r.get("speedup")
                ent["measured"][str(r["M"])] = {
                    "speedup": None if sp is None or sp != sp else round(float(sp), 4),
                    "ours_us": r.get("ours_us"), "vllm_us": r.get("vllm_us"),
                    "cfg": r.get("cfg"), "error": (r.get("error") or "")[:80] or None,
                    "part": part}
    for ent in acc.values():
        pts = {int(m): v["speedup"] for m, v in ent["measured"].items()}
        ent["ranges"] = build_ranges(pts, threshold)
    return {"device": device, "threshold": threshold, "sources": sources,
            "rule": "ours iff speedup >= threshold at a measured M, or at both measured "
                    "neighbours at most 2x apart in between; above the largest measured M, "
                    "errors, unmeasured M gaps: vllm", "shapes": dict(sorted(acc.items()))}


def main(argv: list[str] | None = None) -> int:
    from kernels.moe import configs, routing

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+",
                    help="bench_kernels results.json files or `moe-serve tune` routing tables")
    ap.add_argument("--device", default="NVIDIA_H200")
    ap.add_argument("--out", default=str(configs.CONFIG_DIR))
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    args = ap.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.results]
    srcs = []
    for p in args.results:
        try:
            srcs.append(str(Path(p).resolve().relative_to(ROOT)))
        except ValueError:
            srcs.append(str(p))
    table = build(results, args.device, srcs, args.threshold)
    out = Path(args.out) / routing.file_name(args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    for key, ent in table["shapes"].items():
        print(f"{ent['name']:22s} {key:36s} " + ", ".join(
            f"{r['m_min']}-{'' if r['m_max'] is None else r['m_max']}:{r['backend']}"
            for r in ent["ranges"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
