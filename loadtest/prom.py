"""Scrape `/metrics` and count serving-phase Triton JIT compiles between two scrapes."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

JIT_FAMILY = "moe_serve_triton_jit_compiles"           # a counter: its samples are JIT_FAMILY_total
JIT_METRIC = JIT_FAMILY + "_total"


def scrape(base_url: str, api_key: str = "", timeout_s: float = 10.0) -> str | None:
    """The /metrics text, or None when it cannot be read (no endpoint, auth, network)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]] | None:
    """(labels, value) of every sample named `name` (prometheus_client's parser of the text
    format); None when no family holds such a sample nor is declared under that name."""
    found, declared = [], False
    for family in text_string_to_metric_families(text):
        declared |= name in (family.name, family.name + "_total")
        found += [(dict(s.labels), float(s.value)) for s in family.samples if s.name == name]
    return found if found or declared else None


def serving_compiles(text: str | None) -> dict[str, float] | None:
    """Serving-phase compiles per kernel; None when the server does not export the metric."""
    found = None if text is None else samples(text, JIT_METRIC)
    if found is None:
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
