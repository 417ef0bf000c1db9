"""A/B comparison of two run reports of the same scenario: per-stage B/A ratios."""

from __future__ import annotations

import json
from pathlib import Path

from moe_serve.loadtest.report import compiles_text, fmt

RATIO_KEYS = (("output tok/s", "output_tok_s"), ("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p99 ms", "ttft_p99_ms"),
              ("ITL p50 ms", "itl_p50_ms"), ("req/s", "req_s"))


def ratio(b: float | None, a: float | None) -> float | None:
    return None if a in (None, 0) or b is None else b / a


def compare(a: dict, b: dict, label_a: str = "A", label_b: str = "B") -> dict:
    """Rows of (stage, users, A value, B value, B/A) for each metric in RATIO_KEYS."""
    rows = []
    for sa, sb in zip(a["stages"], b["stages"]):
        row = {"stage": sa["label"], "users": sa["users"], "requests_a": sa["requests"], "requests_b": sb["requests"],
               "errors_a": sa["errors"], "errors_b": sb["errors"]}
        for _, key in RATIO_KEYS:
            row[f"{key}_a"], row[f"{key}_b"] = sa[key], sb[key]
            row[f"{key}_ratio"] = ratio(sb[key], sa[key])
        rows.append(row)
    return {"label_a": label_a, "label_b": label_b, "scenario": a["meta"]["scenario"]["name"], "rows": rows,
            "compiles_a": a["serving_jit_compiles"], "compiles_b": b["serving_jit_compiles"]}


def markdown(ab: dict) -> str:
    """The ratio table: for each stage, A, B and B/A of throughput and latency."""
    la, lb = ab["label_a"], ab["label_b"]
    head = ["stage", "users", "err A/B"]
    for name, _ in RATIO_KEYS[:4]:
        head += [f"{name} {la}", f"{name} {lb}", "B/A"]
    lines = [f"## A/B `{ab['scenario']}`: A = {la}, B = {lb}", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in ab["rows"]:
        cells = [r["stage"], str(r["users"]), f"{r['errors_a']}/{r['errors_b']}"]
        for _, key in RATIO_KEYS[:4]:
            spec = "{:.1f}"
            cells += [fmt(r[f"{key}_a"], spec), fmt(r[f"{key}_b"], spec), fmt(r[f"{key}_ratio"], "{:.3f}")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Serving-phase JIT compiles: {la}: {compiles_text(ab['compiles_a'])}; "
              f"{lb}: {compiles_text(ab['compiles_b'])}", ""]
    return "\n".join(lines)


def write_ab(dir_a: Path, dir_b: Path, out: Path, label_a: str = "A", label_b: str = "B") -> dict:
    """Read both report.json files, write ab.json and ab.md into `out`, return the comparison."""
    a = json.loads((Path(dir_a) / "report.json").read_text())
    b = json.loads((Path(dir_b) / "report.json").read_text())
    ab = compare(a, b, label_a, label_b)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(ab, indent=2))
    (out / "ab.md").write_text(markdown(ab))
    return ab
