"""Scrape `/metrics` and count serving-phase Triton JIT compiles between two scrapes."""

from __future__ import annotations

import re

import httpx

JIT_METRIC = "moe_serve_triton_jit_compiles_total"
_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(base_url: str, api_key: str = "", timeout_s: float = 10.0) -> str | None:
    """The /metrics text, or None when it cannot be read (no endpoint, auth, network)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric `name` in Prometheus text format."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m["name"] == name:
            out.append((dict(_LABEL.findall(m["labels"] or "")), float(m["value"])))
    return out


def serving_compiles(text: str | None) -> dict[str, float] | None:
    """Serving-phase compiles per kernel; None when the server does not export the metric."""
    if text is None:
        return None
    found = samples(text, JIT_METRIC)
    if not found and f"# TYPE {JIT_METRIC.removesuffix('_total')}" not in text and JIT_METRIC not in text:
        return None
    per_kernel: dict[str, float] = {}
    for labels, value in found:
        if labels.get("phase") == "serving":
            kernel = labels.get("kernel", "?")
            per_kernel[kernel] = per_kernel.get(kernel, 0.0) + value
    return per_kernel


def compiles_delta(before: str | None, after: str | None) -> dict | None:
    """{'total': n, 'per_kernel': {...}} compiled between the scrapes, or None ("n/a")."""
    a, b = serving_compiles(before), serving_compiles(after)
    if b is None:
        return None
    a = a or {}
    per = {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0) > 0}
    return {"total": sum(per.values()), "per_kernel": per}
