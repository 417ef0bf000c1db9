"""The expert load of one run: the server's GET /v1/moe/expert-load before and after it, and per MoE
layer what the run routed (the difference of the `total` views): tokens, imbalance (the busiest
expert's load over the mean), idle experts, the busiest expert's share. How the run's traffic
spread over the experts, beside its TTFT and ITL."""

from __future__ import annotations

import time

import httpx
import numpy as np

from moe_serve.kernels.plugin.expert_snapshot import load_summary

PATH = "/v1/moe/expert-load"
BEFORE_FILE, AFTER_FILE = "expert_load_before.json", "expert_load_after.json"


def fetch(host: str, api_key: str = "", newer_than: float | None = None, wait_s: float = 5.0) -> dict | None:
    """The endpoint's body (None when the server has none: --no-expert-stats, another server, no
    key); with newer_than, waits up to wait_s for the workers' snapshots (every second) to be
    younger than that unix time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = httpx.get(host.rstrip("/") + PATH, headers=headers, timeout=10)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        body = r.json()
        fresh = newer_than is None or (body.get("as_of") or 0) > newer_than
        if fresh or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def run_load(before: dict | None, after: dict | None) -> dict | None:
    """{"layers": [per layer: layer, experts, top_k, tokens, routed, imbalance, idle_experts,
    busiest_share], "restarted": bool} routed between the two bodies; None without both. If the
    server began serving again in between (counts zeroed), the run's load is `after`'s total."""
    if not before or not after or not after.get("layers"):
        return None
    restarted = before.get("serving_since") != after.get("serving_since")
    base = {} if restarted else {layer["name"]: layer["total"] for layer in before.get("layers", [])}
    rows = []
    for layer in after["layers"]:
        counts = np.asarray(layer["total"], dtype=np.int64) - np.asarray(base.get(layer["name"], 0), dtype=np.int64)
        summary = load_summary(counts, layer["top_k"])
        rows.append({"layer": layer["layer"], "experts": layer["experts"], "top_k": layer["top_k"], **summary,
                     "busiest_share": round(float(counts.max()) / summary["routed"], 4) if summary["routed"] else None})
    return {"layers": rows, "restarted": restarted}


def markdown_lines(load: dict | None) -> list[str]:
    """The run's expert load as a markdown table (or one line saying why there is none)."""
    if load is None:
        return ["Expert load: n/a (the server has no GET /v1/moe/expert-load: --no-expert-stats, or not moe-serve)"]
    fmt = lambda v, spec: "-" if v is None else spec.format(v)  # noqa: E731
    lines = ["Expert load of the run (per MoE layer: tokens routed, imbalance = busiest expert / mean, "
             "experts that got no token, the busiest expert's share of the layer's routing):", "",
             "| layer | experts | top-k | tokens | imbalance | idle experts | busiest share |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in load["layers"]:
        lines.append(f"| {r['layer']} | {r['experts']} | {r['top_k']} | {r['tokens']} | "
                     f"{fmt(r['imbalance'], '{:.2f}')} | {r['idle_experts']} | {fmt(r['busiest_share'], '{:.1%}')} |")
    if load["restarted"]:
        lines += ["", "(the server began serving again during the run: its load since then)"]
    return lines
