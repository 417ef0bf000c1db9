"""`moe-serve bench kernels --router`: the MoE router at decode, our one launch
(moe_serve.kernels.moe.router_topk, each top-k method) against vLLM's two (the gate GEMM as the model runs it,
F.linear in the gate's dtype, then vLLM's fused top-k op).

    moe-serve bench kernels --router --model DIR --out OUT          the model's router (config.json)
    moe-serve bench kernels --router --router-shapes qwen3-30b-a3b,mixtral-8x7b --out OUT
    TRITON_INTERPRET=1 moe-serve bench kernels --router --smoke --out OUT       CPU, a tiny router

Per router shape and M (1, 2, 4, 8, 16 by default): each method of ours is checked against a float64
reference (the experts chosen, up to near-ties of the choice key; the weights) on fresh inputs into
poisoned outputs, the methods against each other (bit-equal), and against vLLM's op where vLLM is
importable (the same experts up to near-ties of its bf16 logits, weights within 1e-2); then each
is timed as CUDA-graph replays over rotated input sets (a different gate per set, as each layer has
its own): median us, vLLM's time / ours. Rows: OUT/results.json ("router"); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from moe_serve.bench.experts.problem import CUDA, DEV, log, named
from moe_serve.kernels.moe.router_topk import SERVED_TOPK_METHOD, TOPK_METHODS, router_topk
from moe_serve.kernels.tuning.timing import time_graph

ROUTER_MS = (1, 2, 4, 8, 16)
VLLM_TIE = 0.05              # logit gap under which vLLM's bf16 logits may swap two experts
MAX_WEIGHT_DIFF = 1e-2       # against vLLM's op: bf16 logits
REF_TIE = 1e-4               # against float64 on the same inputs: fp32 accumulation only
REF_WEIGHT_TOL = 1e-4


@dataclass(frozen=True)
class RouterShape:
    """A model's router: E experts over hidden size K, its top-k and scoring (config.json)."""

    E: int
    K: int
    topk: int
    scoring: str = "softmax"
    renormalize: bool = True
    bias: bool = False               # e_score_correction_bias (the choice only)
    scaling: float = 1.0             # routed_scaling_factor


NAMED = {
    "qwen3-30b-a3b": RouterShape(128, 2048, 8),
    "qwen3-235b-a22b": RouterShape(128, 4096, 8),
    "mixtral-8x7b": RouterShape(8, 4096, 2),
    "glm-4.5-air": RouterShape(128, 4096, 8, "sigmoid", True, True, 1.0),
}
DEFAULT_NAMED = ("qwen3-30b-a3b", "mixtral-8x7b", "glm-4.5-air")
SMOKE = {"tiny": RouterShape(16, 64, 4), "tiny-sigmoid": RouterShape(12, 48, 3, "sigmoid", True, True, 2.0)}


def router_shape(cfg: dict[str, Any]) -> RouterShape:
    """The router of a Hugging Face MoE config (Mixtral, Qwen-MoE, DeepSeek-V2/V3 families)."""
    E = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    topk = cfg.get("num_experts_per_tok")
    if not E or not topk:
        raise ValueError("config.json names no expert count or top-k: not a MoE model")
    if (cfg.get("n_group") or 1) > 1 and (cfg.get("topk_group") or 1) < cfg["n_group"]:
        raise ValueError("grouped top-k routers run on vLLM's router (moe_serve.kernels.moe.router_topk does not cover them)")
    return RouterShape(int(E), int(cfg["hidden_size"]), int(topk), cfg.get("scoring_func") or "softmax",
                       cfg.get("norm_topk_prob") is not False, cfg.get("topk_method") == "noaux_tc",
                       float(cfg.get("routed_scaling_factor") or 1.0))


def _choice_keys(x: torch.Tensor, gate: torch.Tensor, shape: RouterShape, bias: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(score, choice key) [M, E] in float64 from the same inputs, and the key's scale against
    logits (the choice's order: logits for softmax without a bias, else score + bias, whose
    slope is at most 1/4 a logit for sigmoid)."""
    logits = x.double() @ gate.double().T
    score = logits.softmax(-1) if shape.scoring == "softmax" else logits.sigmoid()
    if shape.scoring == "softmax" and bias is None:
        return score, logits, 1.0
    return score, score + (bias.double() if bias is not None else 0), 0.25


def _decided_at_tie(ids: torch.Tensor, key: torch.Tensor, topk: int, tie: float) -> torch.Tensor:
    """[M] bool: rows whose experts are not the key's top-k set, allowed only where the k-th and
    (k+1)-th keys sit within `tie`; raises elsewhere."""
    best = key.topk(min(topk + 1, key.shape[1]), -1).values
    ours = key.gather(1, ids.long()).sort(-1, descending=True).values
    other = (ours - best[:, :topk]).abs().max(-1).values > 1e-12
    gap = best[:, topk - 1] - best[:, topk] if topk < key.shape[1] else torch.full_like(best[:, 0], float("inf"))
    if bool((other & (gap.abs() >= tie)).any()):
        raise AssertionError(f"experts differ from the reference away from a near-tie: {ids.tolist()}")
    return other


def check_reference(shape: RouterShape, out: tuple[torch.Tensor, torch.Tensor], score: torch.Tensor,
                    key: torch.Tensor, scale: float) -> int:
    """Ours against float64 on the same inputs: distinct ids in range, the reference's top-k but
    at near-ties (REF_TIE), weights = the reference's scores at our ids (renormalised, scaled)
    within REF_WEIGHT_TOL. Returns the rows decided at a near-tie."""
    w, ids = out
    if not bool(((ids >= 0) & (ids < shape.E)).all()) or any(len(set(r)) != shape.topk for r in ids.tolist()):
        raise AssertionError(f"ids out of range or repeated: {ids.tolist()}")
    at_tie = _decided_at_tie(ids, key, shape.topk, REF_TIE * scale)
    want = score.gather(1, ids.long())
    if shape.renormalize:
        want = want / want.sum(-1, keepdim=True)
    err = float((w.double() - want * shape.scaling).abs().max())
    if err > REF_WEIGHT_TOL:
        raise AssertionError(f"weights differ from float64 by {err:.3g}")
    return int(at_tie.sum())


def vllm_router(shape: RouterShape) -> Callable | None:
    """vLLM's top-k op for this shape, (hidden, logits, bias) -> (weights, ids); None without vLLM's ops."""
    try:
        if shape.bias:
            from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import fused_topk_bias

            return lambda x, logits, bias: fused_topk_bias(x, logits, shape.scoring, bias, shape.topk,
                                                            shape.renormalize,
                                                            routed_scaling_factor=shape.scaling)[:2]
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    except ImportError:
        return None
    return lambda x, logits, bias: fused_topk(x, logits, shape.topk, shape.renormalize, scoring_func=shape.scoring)[:2]


def check_vllm(shape: RouterShape, ours: tuple, theirs: tuple, key: torch.Tensor, scale: float) -> float:
    """Ours against vLLM's op: vLLM's experts are the float64 top-k but at near-ties of its bf16
    logits (VLLM_TIE), so are ours; where both sets agree, the largest weight difference (at most
    MAX_WEIGHT_DIFF)."""
    (w, ids), (vw, vids) = ours, theirs
    _decided_at_tie(vids, key, shape.topk, VLLM_TIE * scale)
    o, v = ids.long().sort(-1), vids.long().sort(-1)
    same = (o.values == v.values).all(-1)
    diff = (w.gather(1, o.indices) - vw.float().gather(1, v.indices)).abs()[same]
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst > MAX_WEIGHT_DIFF:
        raise AssertionError(f"weights differ from vLLM's by {worst:.3g}")
    return worst


def run_cell(name: str, shape: RouterShape, M: int, sets: int, replays: int) -> dict[str, Any]:
    """One (shape, M): checks, then the median us of every method and of vLLM's two launches."""
    g = torch.Generator(device=DEV).manual_seed(torch.seed() % 2 ** 31)
    dtype = torch.bfloat16 if CUDA else torch.float16           # the interpreter's dot has no bf16
    gates = [(torch.randn(shape.E, shape.K, device=DEV, generator=g) / shape.K ** 0.5).to(dtype) for _ in range(sets)]
    xs = [torch.randn(M, shape.K, device=DEV, generator=g).to(dtype) for _ in range(sets)]
    bias = torch.rand(shape.E, device=DEV, generator=g) * 0.2 if shape.bias else None
    score, key, scale = _choice_keys(xs[0], gates[0], shape, bias)
    row: dict[str, Any] = {"shape": name, **asdict(shape), "M": M}
    outs = {}
    for method in TOPK_METHODS:
        out = (torch.full((M, shape.topk), float("nan"), device=DEV),
               torch.full((M, shape.topk), -1, dtype=torch.int32, device=DEV))
        router_topk(xs[0], gates[0], shape.topk, shape.scoring, shape.renormalize, bias=bias,
                    scaling=shape.scaling, out=out, method=method)
        row[f"{method}_near_ties"] = check_reference(shape, out, score, key, scale)
        outs[method] = out
    first, *others = outs.values()
    if any(not torch.equal(first[1], o[1]) for o in others):
        raise AssertionError(f"the top-k methods pick differently: {[o[1].tolist() for o in outs.values()]}")
    # weights: each method's already checked against float64 above; on the GPU they may differ in the last bits
    row["methods_max_weight_diff"] = max(((first[0] - o[0]).abs().max().item() for o in others), default=0.0)
    for method in TOPK_METHODS:
        row[f"{method}_us"] = round(time_graph(
            lambda i, m=method: router_topk(xs[i], gates[i], shape.topk, shape.scoring, shape.renormalize,
                                            bias=bias, scaling=shape.scaling, method=m), sets, replays), 2)
    theirs = vllm_router(shape) if CUDA else None
    if theirs is not None:
        def vllm(i: int) -> tuple:
            return theirs(xs[i], torch.nn.functional.linear(xs[i], gates[i]), bias)

        row["vllm_max_weight_diff"] = check_vllm(shape, first, vllm(0), key, scale)
        row["vllm_us"] = round(time_graph(vllm, sets, replays), 2)
    return row


def part_router(shapes: dict[str, RouterShape], ms: tuple[int, ...], sets: int, replays: int) -> list[dict]:
    rows = []
    for name, shape in shapes.items():
        for M in ms:
            try:
                rows.append(run_cell(name, shape, M, sets, replays))
            except Exception as e:  # noqa: BLE001 - a failed cell is a row, the rest still run
                traceback.print_exc()
                rows.append({"shape": name, "M": M, "error": f"{type(e).__name__}: {e}"[:500]})
            log(json.dumps(rows[-1]))
    return rows


def table(rows: list[dict]) -> list[str]:
    """Markdown: per (shape, M) each method's us, vLLM's us and vLLM's / ours for each method."""
    head = " | ".join(f"ours {m} us" for m in TOPK_METHODS)
    ratios = " | ".join(f"vLLM / {m}" for m in TOPK_METHODS)
    out = [f"| shape | E x K, top-k | M | {head} | vLLM us | {ratios} |",
           "|---|---|---:|" + "---:|" * (2 * len(TOPK_METHODS) + 1)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | | {r['M']} | error: {r['error'][:80]} |")
            continue
        vl = r.get("vllm_us")
        us = " | ".join(f"{r[f'{m}_us']:.2f}" for m in TOPK_METHODS)
        rat = " | ".join(f"{vl / r[f'{m}_us']:.2f}" if vl else "—" for m in TOPK_METHODS)
        out.append(f"| {r['shape']} | {r['E']} x {r['K']}, {r['topk']} | {r['M']} | {us} | "
                   f"{f'{vl:.2f}' if vl else '—'} | {rat} |")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--router", action="store_true", help="only the MoE router at decode (router.py): our one "
                    "launch, each top-k method, vs vLLM's gate GEMM + fused top-k at M 1..16")
    ap.add_argument("--router-shapes", default=None, help="with --router and no --model: comma list of named "
                    f"routers (default {','.join(DEFAULT_NAMED)}; known: {','.join(NAMED)})")


def main(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> int:
    """The --router part: its rows into results (saved by `save`), the table printed."""
    ms = ROUTER_MS
    if args.smoke:
        shapes, ms = SMOKE, (1, 3)
    elif args.model:
        try:
            shapes = {Path(args.model).name: router_shape(json.loads((Path(args.model) / "config.json").read_text()))}
        except ValueError as e:
            log(f"moe-serve bench kernels --router: {e}")
            return 2
    elif (shapes := named(args.router_shapes, DEFAULT_NAMED, NAMED, "routers")) is None:
        return 2
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else ms
    t0 = time.perf_counter()
    results["router"] = part_router(shapes, ms, args.sets, args.replays)
    save()
    log("\n".join(table(results["router"])))
    log(f"router part: {time.perf_counter() - t0:.0f}s (serving launches the {SERVED_TOPK_METHOD!r} top-k)")
    return 1 if any("error" in r for r in results["router"]) else 0
