"""The plugin's warm-up: before serving, compile every kernel variant serving can hit.

For each MoE layer shape seen during vLLM's own warm-up: our kernel's variants (when the
routing table sends any M of the shape to ours) and vLLM's original TritonExperts.apply, with
the layer's real weights and quant config, at every M routed to vLLM that could specialize
its kernel differently (warmup_plan). Env: MOE_SERVE_VLLM_WARMUP_MAX_CALLS (cap per shape, 4096).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

from kernels.plugin_state import (limits, log_once, pending_shapes, report, route_dtype, vllm_ctx,
                                  vllm_warmed, warmed_shapes)

VLLM_WARMUP_MAX_CALLS_ENV = "MOE_SERVE_VLLM_WARMUP_MAX_CALLS"


def warm_pending() -> None:
    """For each MoE layer shape seen and not yet warmed: compile our kernels' variants (when
    the routing table sends any M of the shape to ours) and run vLLM's own TritonExperts path
    for every M the routing sends to vLLM (warm_vllm), so serving compiles nothing."""
    if not pending_shapes:
        return
    from kernels import configs, routing
    from kernels.warmup import warmup

    max_tokens = limits.max_num_batched_tokens or 8192
    max_seqs = limits.max_num_seqs or 256
    t0 = time.perf_counter()
    swaps: set[bool] = set()
    rep = report()
    info = dict(rep.data.get("kernel_info") or {})
    route_info = dict(info.get("routing") or {})
    for key, shape in list(pending_shapes.items()):
        s = time.perf_counter()
        wname = route_dtype(shape["fp8"], shape["dtype"])
        E, N, K = shape["E"], shape["N"], shape["K"]
        plan = warmup_plan(routing.ranges(E, N, K, wname), max_seqs, max_tokens, shape["topk"],
                           E, policy=routing.policy(), cfg_key=_vllm_cfg_key(key))
        route_info[routing.shape_key(E, N, K, wname)] = routing.describe(E, N, K, wname)
        n = 0
        if plan["ours"]:
            n = warmup(E, N, K, shape["topk"], shape["dtype"], max_tokens,
                       fp8=shape["fp8"], device=shape["device"], static_act=shape["static_act"],
                       router_weight_on_input=shape["router_on_input"],
                       ids_dtypes=(shape["ids_dtype"],))
            for b in configs.buckets_for(E, N, K, wname):
                cfg = configs.get_config(b, E, N, K, shape["topk"], wname)
                swaps.add(bool(cfg.get("SWAP_AB")))
        nv = warm_vllm(key, plan["vllm"]) if plan["vllm"] else 0
        print(f"[moe-serve warmup] rank {rep.data.get('rank')}: E={E} N={N} K={K} "
              f"topk={shape['topk']} {shape['dtype']} fp8={shape['fp8']}: ours {n} variants up to "
              f"M={max_tokens}; vLLM kernel {nv} calls ({len(plan['vllm'])} planned M) in "
              f"{time.perf_counter() - s:.1f}s; routing {route_info[routing.shape_key(E, N, K, wname)]}",
              flush=True)
        warmed_shapes.add(key)
        pending_shapes.pop(key, None)
    seconds = time.perf_counter() - t0
    info["swap_ab"] = "mixed" if len(swaps) > 1 else str(swaps.pop()).lower() if swaps else "n/a"
    info["routing"] = route_info
    prev = rep.data.get("warmup") or {"seconds": 0.0, "shapes": 0}
    rep.update(kernel_info=info, warmup={"seconds": round(prev["seconds"] + seconds, 3),
                                         "shapes": len(warmed_shapes), "max_tokens": max_tokens,
                                         "max_num_seqs": max_seqs})
    print(f"[moe-serve warmup] rank {rep.data.get('rank')}: done in {seconds:.1f}s", flush=True)


def _vllm_cfg_key(key: tuple) -> Callable[[int], Any] | None:
    """vLLM's own config choice for M (try_get_optimal_moe_config, same signature in 0.26 and
    0.32) as a hashable key, or None when it cannot be called (then _vllm_group approximates)."""
    ctx = vllm_ctx.get(key)
    if ctx is None:
        return None
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        import torch

        w1s, w2s = tuple(ctx["w1"].shape), tuple(ctx["w2"].shape)
        dt = "fp8_w8a8" if ctx["w1"].dtype == torch.float8_e4m3fn else None

        def cfg_key(M: int) -> str:
            return repr(sorted(try_get_optimal_moe_config(w1s, w2s, ctx["topk"], dt, M).items()))

        cfg_key(1)
        return functools.lru_cache(maxsize=None)(cfg_key)
    except Exception:  # noqa: BLE001
        return None


def _vllm_group(M: int, topk: int, cfg_key: Callable[[int], Any] | None) -> tuple:
    """Specialization class of vLLM's fused_moe_kernel for M tokens: its config bucket
    (vLLM's own get_config when given, else ~ its key grid: powers of two and 1.5x), M == 1,
    and (M * topk) mod 16 (num_valid_tokens and EM = M*topk + const divisibility)."""
    if cfg_key is not None:
        ck = cfg_key(M)
    else:
        b = M.bit_length()
        ck = (b, M >= 3 << max(0, b - 2))
    return (ck, M == 1, (M * topk) % 16)


def warmup_plan(rngs: list[dict], max_seqs: int, max_tokens: int, topk: int, E: int,
                policy: str = "table", cfg_key: Callable[[int], Any] | None = None,
                max_calls: int | None = None) -> dict[str, Any]:
    """Which backend serves which M, and the M values to run vLLM's kernel at in warm-up.

    {"ours": bool (any M routed to ours -> compile our variants), "vllm": sorted M list}.
    vLLM M list: every M in 1..min(max_seqs, max_tokens) routed to vLLM (decode batch sizes),
    plus for the prefill range (max_seqs, max_tokens] one M per specialization class of vLLM's
    kernel (_vllm_group), i.e. at most 16 per vLLM config bucket; capped at max_calls
    (env MOE_SERVE_VLLM_WARMUP_MAX_CALLS, default 4096) keeping the decode M first."""
    from kernels.routing import OURS, VLLM, route_in

    def backend(M: int) -> str:
        return policy if policy in (OURS, VLLM) else route_in(rngs, M)

    if max_calls is None:
        max_calls = int(os.environ.get(VLLM_WARMUP_MAX_CALLS_ENV, "4096"))
    top = max(1, max_tokens)
    dec = min(max_seqs, top)
    ours = any(backend(m) == OURS for m in _range_probe(rngs, top))
    ms = [m for m in range(1, dec + 1) if backend(m) == VLLM]
    seen: set[tuple] = set()
    for m in range(dec + 1, top + 1):
        if backend(m) != VLLM:
            continue
        g = _vllm_group(m, topk, cfg_key)
        if g not in seen:
            seen.add(g)
            ms.append(m)
    return {"ours": ours, "vllm": ms[:max_calls], "dropped": max(0, len(ms) - max_calls)}


def _range_probe(rngs: list[dict], top: int) -> list[int]:
    """M values that hit every range of a routing table up to top (plus 1 and top)."""
    pts = {1, top}
    for r in rngs:
        if r["m_min"] <= top:
            pts.add(r["m_min"])
    return sorted(pts)


def warm_vllm(key: tuple, ms: list[int]) -> int:
    """Run vLLM's original TritonExperts.apply with the layer's real weights / quant config at
    each M in ms (random hidden states and routing); returns the number of calls made."""
    ctx = vllm_ctx.get(key)
    if ctx is None or key in vllm_warmed:
        return 0
    import torch

    vllm_warmed.add(key)
    orig, experts = ctx["orig"], ctx["experts"]
    w1, w2 = ctx["w1"], ctx["w2"]
    E, K = w1.size(0), w1.size(2)
    dev = w1.device
    n = 0
    for M in ms:
        if ctx["hidden_dtype"] == torch.float8_e4m3fn:
            x = torch.randn(M, K, device=dev).to(ctx["hidden_dtype"])
        else:
            x = torch.randn(M, K, device=dev, dtype=ctx["hidden_dtype"])
        topk = ctx["topk"]
        # distinct experts per row (topk <= E), rows spread over all experts
        ids = (torch.arange(M * topk, device=dev) % E).reshape(M, topk).to(ctx["ids_dtype"])
        tw = torch.full((M, topk), 1.0 / topk, device=dev, dtype=ctx["tw_dtype"])
        out = torch.empty(M, K, device=dev, dtype=ctx["out_dtype"])
        ws13 = torch.empty((M + 1) * ctx["ws13_per_row"], device=dev, dtype=ctx["ws13_dtype"])
        ws2 = torch.empty((M + 1) * ctx["ws2_per_row"], device=dev, dtype=ctx["ws2_dtype"])
        try:
            orig(experts, output=out, hidden_states=x, w1=w1, w2=w2, topk_weights=tw,
                 topk_ids=ids, activation=ctx["activation"],
                 global_num_experts=ctx["global_num_experts"], expert_map=None,
                 a1q_scale=ctx["a1q_scale"], a2_scale=ctx["a2_scale"], workspace13=ws13,
                 workspace2=ws2, expert_tokens_meta=None,
                 apply_router_weight_on_input=ctx["router_on_input"])
            n += 1
        except Exception as exc:  # noqa: BLE001 - one failing M must not stop the others
            report().count("vllm_warmup_errors", type(exc).__name__)
            log_once(type(exc).__name__, "moe-serve: vLLM kernel warm-up failed at M=%d: %r", M, exc)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return n
