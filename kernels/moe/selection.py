"""Which kernel serves M tokens of a MoE layer shape, and why: one decision, which each MoE
layer's plan (kernels/plugin/layer_plan.py) holds per bucket for the hooks, `moe-serve explain`
and the reports; fused_moe asks it directly only when called without a config (benchmarks, tuner).

For a shape (E experts, N per-rank intermediate, K hidden, topk, dtype key) and M:

- route, ours or vLLM: the moe_routing setting ``ours|vllm`` forces it (kernels/config.py). Else the routing table's
  range holding M (moe_serve.kernels.moe.routing), with the measured ratio behind it (vLLM's time / ours
  at the measured M of that range nearest to M) and the table's reason for that point. A
  shape whose tuned config table was refused ignores its routing entry too (it was measured
  with the refused configs). A shape no table names takes the default rule when topk is known,
  else vLLM.
- config ours runs: the tuned table's entry for M's bucket (env dir, tuner cache or shipped
  table: moe_serve.kernels.moe.configs), else the default rule's (decode-path heuristic, vLLM's config
  for the shape, or the aligned heuristic); then fitted into Hopper's shared memory
  (configs.fit: smem.fit, and block FP8's BLOCK_K), every shrink recorded and logged once.
- path: 'ours decode' or 'ours aligned' (the config's DECODE flag) where routed to ours and
  supported, else 'vllm' with the fallback reason.

Under CUDA graphs the choice for a captured batch size is made once, at capture.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

from moe_serve.kernels.moe import configs, heuristics, routing
from moe_serve.kernels.moe.config_schema import Config, label

OURS_DECODE, OURS_ALIGNED, VLLM = "ours decode", "ours aligned", "vllm"
DEFAULT_RULE = "default rule"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigChoice:
    """The config ours runs for a bucket and where it came from."""

    config: Config              # after the shared-memory fit
    source: str                 # configs.ENV_DIR | TUNER_CACHE | SHIPPED | DEFAULT_RULE
    detail: str                 # the table's path, or which default
    bucket: int
    shrunk: tuple[str, ...]     # configs.fit's changes, e.g. ('num_stages 5->4',)
    refused: tuple[str, ...]    # table files refused on the way (another Triton version)

    @property
    def label(self) -> str:
        return label(self.config)


@dataclass(frozen=True)
class RouteChoice:
    """Ours or vLLM for M, and the evidence."""

    backend: str                # routing.OURS | routing.VLLM
    rule: str                   # what decided: env, a routing file, the default rule
    ratio: float | None         # vLLM's time / ours at measured_m (> 1: ours faster)
    measured_m: int | None
    why: str                    # the reason for M's range


@dataclass(frozen=True)
class Selection:
    """Everything that decides which kernel serves M tokens of one layer shape."""

    M: int
    path: str                   # OURS_DECODE | OURS_ALIGNED | VLLM
    config: ConfigChoice        # what ours runs (or would run, where vLLM serves)
    route: RouteChoice
    fallback: str | None        # why vLLM serves; None when ours does


def _fit_changes(before: Config, after: Config) -> tuple[str, ...]:
    """'key old->new' for every value configs.fit changed (GEMM2's as 'DOWN.key')."""
    out = [f"{k} {before[k]}->{after[k]}" for k in after if k != "DOWN" and before.get(k) != after[k]]
    down_before, down_after = before.get("DOWN", {}), after.get("DOWN", {})
    out += [f"DOWN.{k} {down_before.get(k)}->{v}" for k, v in down_after.items()
            if k in down_before and down_before[k] != v]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _bucket_choice(bucket: int, E: int, N: int, K: int, topk: int, dtype: str, device: str,
                   act_bytes: int, triton_version: str | None) -> ConfigChoice:
    found = configs.find_table(E, N, K, dtype, device, triton_version)
    if found.table:
        raw, source, detail = found.table[bucket], found.source, str(found.path)
    else:
        raw = configs.default_config(bucket, E, N, K, topk, dtype, device)
        source, detail = DEFAULT_RULE, configs.default_source(bucket, E, N, K, topk, dtype, device)
    fitted = configs.fit(raw, dtype, act_bytes, topk)
    shrunk = _fit_changes(raw, fitted)
    if shrunk:
        logger.info("moe-serve: shared-memory fit of E=%d N=%d K=%d %s bucket %d (%s): %s",
                    E, N, K, dtype, bucket, source, ", ".join(shrunk))
    return ConfigChoice(fitted, source, detail, bucket, shrunk, found.refused)


FP8_GEMV_BUCKETS = (1, 2, 4, 8, 16)    # the fp8_moe_gemv setting's buckets: the CUDA-core decode path
FP8_GEMV = "fp8_moe_gemv setting"


@functools.lru_cache(maxsize=None)
def fp8_gemv_choice(bucket: int, E: int, N: int, K: int, topk: int, dtype: str, device: str,
                    act_bytes: int, triton_version: str | None) -> ConfigChoice:
    """The config of the FP8 weight-streaming decode path (moe_serve.kernels.moe.moe_gemv: FP8 weights
    dequantized in registers) for a bucket of FP8_GEMV_BUCKETS: the tuned table's entry where it
    is a GEMV config, else the GEMV's seed (heuristics.gemv_config); fitted like every config."""
    found = configs.find_table(E, N, K, dtype, device, triton_version)
    raw = found.table.get(bucket) if found.table else None
    if raw is not None and raw.get("GEMV"):
        source, detail = found.source, str(found.path)
    else:
        raw, source, detail = heuristics.gemv_config(bucket, E, N, K, topk, dtype), FP8_GEMV, "the GEMV's seed config"
    fitted = configs.fit(raw, dtype, act_bytes, topk)
    return ConfigChoice(fitted, source, detail, bucket, _fit_changes(raw, fitted), found.refused)


def buckets_for(E: int, N: int, K: int, dtype: str, device: str | None = None,
                triton_version: str | None = None) -> tuple[int, ...]:
    """The M buckets that select configs for this shape (its table's keys, else M_BUCKETS)."""
    table = configs.load_table(E, N, K, dtype, device or configs.device_name(), triton_version)
    return tuple(sorted(table)) if table else configs.M_BUCKETS


def config_choice(M: int, E: int, N: int, K: int, topk: int, dtype: str, device: str | None = None,
                  act_bytes: int = 2, triton_version: str | None = None) -> ConfigChoice:
    """The config for M tokens (see the module doc). act_bytes: itemsize of fp8 layers'
    hidden states (bf16 2)."""
    device = device or configs.device_name()
    bucket = configs.bucket_of(M, buckets_for(E, N, K, dtype, device, triton_version))
    return _bucket_choice(bucket, E, N, K, topk, dtype, device, act_bytes, triton_version)


@functools.lru_cache(maxsize=4096)
def get_config(M: int, E: int, N: int, K: int, topk: int, dtype: str, device: str | None = None,
               act_bytes: int = 2, triton_version: str | None = None) -> Config:
    """config_choice(...).config, cached per M (fused_moe calls it on every launch)."""
    return config_choice(M, E, N, K, topk, dtype, device, act_bytes, triton_version).config


def _table_entry(E: int, N: int, K: int, dtype: str, device: str,
                 triton_version: str | None) -> tuple[dict[str, Any] | None, str]:
    """The shape's routing entry, or None with the reason the default rule applies."""
    loaded = routing.load(device, triton_version) or {}
    entry = loaded.get("shapes", {}).get(routing.shape_key(E, N, K, dtype))
    if entry is None:
        return None, ("no usable routing table names the shape (refused: another Triton)"
                      if loaded.get("refused") else "no routing table names the shape")
    found = configs.find_table(E, N, K, dtype, device, triton_version)
    if found.table is None and found.refused:
        return None, "its routing was measured with a tuned table that was refused"
    return entry, ""


# Formats whose untuned decode path beat vLLM where measured, so the default rule may route
# their unmeasured shapes to ours. Block-scaled and per-token FP8 did not (0.50-0.96x at M = 1
# and 4 on three shapes on the H200): they run ours only where a
# tuned routing table measured it faster.
DEFAULT_RULE_DTYPES = ("bf16", "fp16", "fp32", "fp8")


def _default_ranges(E: int, N: int, K: int, dtype: str, topk: int | None) -> list[dict]:
    """The default rule's ranges for a shape no table names ([] = all vLLM)."""
    return routing.default_ranges(E, N, K, topk) if topk and dtype in DEFAULT_RULE_DTYPES else []


def ranges(E: int, N: int, K: int, dtype: str, device: str | None = None, topk: int | None = None,
           triton_version: str | None = None) -> list[dict]:
    """The M ranges for a shape: its routing entry's, else the default rule's (needs topk and a
    dtype in DEFAULT_RULE_DTYPES), else [] (all vLLM)."""
    entry, _ = _table_entry(E, N, K, dtype, device or configs.device_name(), triton_version)
    if entry:
        return list(entry.get("ranges", []))
    return _default_ranges(E, N, K, dtype, topk)


def route_choice(E: int, N: int, K: int, dtype: str, M: int, device: str | None = None,
                 topk: int | None = None, triton_version: str | None = None,
                 policy: str | None = None) -> RouteChoice:
    """Ours or vLLM for M tokens, with the evidence (see the module doc); policy: the
    moe_routing setting (default: the process's)."""
    pol = policy or routing.policy()
    if pol != "table":
        return RouteChoice(pol, f"moe_routing={pol}", None, None, "forced by the moe_routing setting")
    device = device or configs.device_name()
    entry, no_entry = _table_entry(E, N, K, dtype, device, triton_version)
    if entry is None:
        if not topk:
            return RouteChoice(routing.VLLM, no_entry, None, None, "top-k unknown: vLLM")
        if dtype not in DEFAULT_RULE_DTYPES:
            return RouteChoice(routing.VLLM, no_entry, None, None,
                               f"{dtype}: untuned, ours only where a tuned table measured it faster")
        backend = routing.route_in(routing.default_ranges(E, N, K, topk), M)
        why = ("the decode path is the default at this M" if backend == routing.OURS
               else "the decode path is not the default at this M")
        return RouteChoice(backend, f"{DEFAULT_RULE} ({no_entry})", None, None, why)
    rngs = entry.get("ranges", [])
    rng = routing.range_of(rngs, M)
    backend = rng["backend"] if rng else routing.VLLM
    inside = {int(m): p for m, p in entry.get("measured", {}).items()
              if rng and rng["m_min"] <= int(m) and (rng["m_max"] is None or int(m) <= rng["m_max"])}
    rule = f"routing table {entry.get('source', '')}".strip()
    if not inside:
        why = "no measured M in this range (unmeasured gap or above the largest measured M)"
        return RouteChoice(backend, rule, None, None, why)
    at = min(inside, key=lambda m: (abs(math.log(m / M)), m))
    point = inside[at]
    why = point.get("why") or ("error: " + point["error"] if point.get("error") else "measured")
    return RouteChoice(backend, rule, point.get("speedup"), at, why)


def route(E: int, N: int, K: int, dtype: str, M: int, device: str | None = None,
          topk: int | None = None, triton_version: str | None = None) -> str:
    """'ours' or 'vllm' for M tokens of this shape (the hook calls it on every MoE call)."""
    pol = routing.policy()
    if pol != "table":
        return pol
    return routing.route_in(ranges(E, N, K, dtype, device, topk, triton_version), M)


def describe(E: int, N: int, K: int, dtype: str, device: str | None = None, topk: int | None = None,
             triton_version: str | None = None) -> str:
    """Compact routing summary for the info metric: '1-16:ours,17+:vllm' ('all:vllm(unmeasured)'
    when nothing routes)."""
    pol = routing.policy()
    if pol != "table":
        return f"all:{pol}"
    return routing.format_ranges(ranges(E, N, K, dtype, device, topk, triton_version)) or "all:vllm(unmeasured)"


def choose(E: int, N: int, K: int, topk: int, dtype: str, M: int, device: str | None = None,
           act_bytes: int = 2, triton_version: str | None = None,
           unsupported: str | None = None) -> Selection:
    """The whole decision for M tokens. unsupported: why the hook cannot run ours on this
    layer at all (its unsupported_reason, e.g. 'fp8_block'), if known."""
    cfg = config_choice(M, E, N, K, topk, dtype, device, act_bytes, triton_version)
    rc = route_choice(E, N, K, dtype, M, device, topk, triton_version)
    if unsupported:
        return Selection(M, VLLM, cfg, rc, f"unsupported by ours: {unsupported}")
    if rc.backend != routing.OURS:
        at = "" if rc.measured_m is None else f" (measured at M={rc.measured_m})"
        return Selection(M, VLLM, cfg, rc, f"routed to vLLM: {rc.why}{at}")
    return Selection(M, OURS_DECODE if cfg.config.get("DECODE") else OURS_ALIGNED, cfg, rc, None)


def clear_caches() -> None:
    """Forget loaded tables and choices (after `moe-serve tune` wrote new ones)."""
    for fn in (configs.find_table, routing.load, _bucket_choice, fp8_gemv_choice, get_config):
        fn.cache_clear()
