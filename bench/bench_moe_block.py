"""The whole MoE block at decode: hidden states -> router -> experts -> output, ours against vLLM's.

    ours            router_topk (one launch) -> fused_moe (the served config: the decode path's
                    two launches, the down kernel a programmatic dependent launch where the config
                    has PDL), as served by default
    ours_block_pdl  the same with the block chained (MOE_SERVE_BLOCK_PDL=1): the router and the up
                    kernel programmatic dependent launches too
    ours_pdl_off    no programmatic dependent launch at all
    vLLM            the gate GEMM (F.linear, as the model runs it) -> vLLM's fused top-k -> fused_experts

Per named shape and M, on random weights (one gate and one set of experts per "layer", N_LAYERS of
them, called in order inside one CUDA graph, as a decode step calls its layers):
1. checks: our routing against vLLM's (bench.bench_router.check: the same experts up to near-ties);
   our experts against vLLM's fused_experts on our routing (relative error of the output);
   ours and ours_block_pdl each replayed from one CUDA graph REPLAY_CHECKS times into poisoned
   outputs, every output compared with the eager one (a launch that read its inputs before the
   kernel before it had written them would change it);
2. timing: CUDA-graph replays of the N_LAYERS blocks, median us per block, for vLLM and the three
   launch patterns of ours, in alternating order.

Needs a CUDA GPU and vLLM.

    python bench/bench_moe_block.py [--shapes qwen3-30b-a3b,...] [--m 1,2,4,8] [--out FILE]
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_router import RouterShape, bench_main, check, vllm_router  # noqa: E402
from kernels.moe import router_topk as router_mod  # noqa: E402
from kernels.moe import selection  # noqa: E402
from kernels.moe.fused_moe import fused_moe  # noqa: E402
from kernels.moe.launch import BLOCK_PDL_ENV  # noqa: E402
from kernels.tuning.timing import time_graph  # noqa: E402


@dataclass(frozen=True)
class BlockShape:
    """One MoE layer at one tensor-parallel rank: E experts of intermediate N over hidden K."""

    E: int
    N: int
    K: int
    router: RouterShape


SHAPES = {
    "qwen3-30b-a3b": BlockShape(128, 768, 2048, RouterShape(128, 2048, 8)),
    "qwen3-235b-a22b-tp8": BlockShape(128, 192, 4096, RouterShape(128, 4096, 8)),
    "glm-4.5-air-tp2": BlockShape(128, 704, 4096, RouterShape(128, 4096, 8, "sigmoid", True, True, 1.0)),
}
N_LAYERS = 8
REPLAY_CHECKS = 50
MAX_REL_ERR = 2e-2           # bf16 output, fp32 accumulation on both sides
ROUNDS = 3                   # alternating timing rounds


@contextlib.contextmanager
def block_pdl(on: bool) -> Iterator[None]:
    """The MoE block chained by PDL (on) or not, whatever the environment says
    (kernels.moe.launch.block_pdl reads MOE_SERVE_BLOCK_PDL per call)."""
    with mock.patch.dict(os.environ, {BLOCK_PDL_ENV: "1" if on else "0"}):
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def make_layers(shape: BlockShape, dtype: torch.dtype, g: torch.Generator) -> list[dict[str, Any]]:
    E, N, K = shape.E, shape.N, shape.K
    layers = []
    for _ in range(N_LAYERS):
        layers.append({
            "gate": torch.randn(E, K, device="cuda", dtype=dtype, generator=g) / K ** 0.5,
            "w1": (torch.randn(E, 2 * N, K, device="cuda", generator=g) / K ** 0.5).to(dtype),
            "w2": (torch.randn(E, K, N, device="cuda", generator=g) / N ** 0.5).to(dtype),
            "bias": torch.rand(E, device="cuda", generator=g) * 0.2 if shape.router.bias else None,
        })
    return layers


def run_shape(name: str, shape: BlockShape, ms: list[int], dtype: torch.dtype) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = make_layers(shape, dtype, g)
    r = shape.router
    theirs_topk = vllm_router(r)
    from kernels.moe import vllm_kernels

    fx = vllm_kernels.fused_experts()
    if fx is None:
        raise RuntimeError("vLLM's fused_experts is not importable")
    fused_experts = fx[0]
    rows = []
    for M in ms:
        xs = [torch.randn(M, shape.K, device="cuda", dtype=dtype, generator=g) for _ in range(N_LAYERS)]
        outs = [torch.empty(M, shape.K, device="cuda", dtype=dtype) for _ in range(N_LAYERS)]
        cfg = selection.get_config(M, shape.E, shape.N, shape.K, r.topk, "bf16")
        cfg_plain = {**cfg, "PDL": False}

        def block(i: int, config: dict) -> torch.Tensor:
            L = layers[i]
            tw, ids = router_mod.router_topk(xs[i], L["gate"], r.topk, r.scoring, r.renormalize,
                                             bias=L["bias"], scaling=r.scaling)
            return fused_moe(xs[i], L["w1"], L["w2"], tw, ids, out=outs[i], config=config)

        def ours(i: int) -> torch.Tensor:
            with block_pdl(False):
                return block(i, cfg)

        def ours_chained(i: int) -> torch.Tensor:
            with block_pdl(True):
                return block(i, cfg)

        def ours_plain(i: int) -> torch.Tensor:
            with block_pdl(False):
                return block(i, cfg_plain)

        def vllm(i: int) -> torch.Tensor:
            L = layers[i]
            logits = torch.nn.functional.linear(xs[i], L["gate"])
            tw, ids = theirs_topk(xs[i], logits, L["bias"])
            return fused_experts(xs[i], L["w1"], L["w2"], tw, ids)

        checks = check_block(ours, layers, xs, r, fused_experts, outs)
        eager = [ours(i).clone() for i in range(N_LAYERS)]       # the default pattern, eagerly
        checks["replay_rel_err_block_pdl"] = check_replays(ours_chained, N_LAYERS, outs, eager)
        fns: dict[str, Callable[[int], Any]] = {"vllm": vllm, "ours": ours, "ours_block_pdl": ours_chained,
                                                "ours_pdl_off": ours_plain}
        times: dict[str, list[float]] = {v: [] for v in fns}
        order = list(fns)
        for k in range(ROUNDS):
            for v in (order if k % 2 == 0 else order[::-1]):
                times[v].append(time_graph(fns[v], N_LAYERS))
        med = {v: statistics.median(t) for v, t in times.items()}
        rows.append({"shape": name, "E": shape.E, "N": shape.N, "K": shape.K, "topk": r.topk,
                     "scoring": r.scoring, "M": M, "config": cfg,
                     "experts_route": selection.route(shape.E, shape.N, shape.K, "bf16", M, topk=r.topk),
                     "router_served_up_to_m": router_mod.max_tokens(r.E, r.K),
                     **{f"{v}_us": round(t, 2) for v, t in med.items()},
                     "speedup_vs_vllm": round(med["vllm"] / med["ours"], 3),
                     "pdl_gain": round(med["ours_pdl_off"] / med["ours"], 3),
                     "block_pdl_gain": round(med["ours"] / med["ours_block_pdl"], 3),
                     "rounds_us": {v: [round(x, 2) for x in t] for v, t in times.items()}, **checks})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def check_block(ours: Callable, layers: list, xs: list, r: RouterShape, fused_experts: Callable,
                outs: list) -> dict[str, Any]:
    """The three checks of the module doc; raises on a failure, else returns their numbers."""
    near_ties, w_diff, err = 0, 0.0, 0.0
    eager = []
    for i, L in enumerate(layers):
        tw, ids = router_mod.router_topk(xs[i], L["gate"], r.topk, r.scoring, r.renormalize,
                                         bias=L["bias"], scaling=r.scaling)
        logits = torch.nn.functional.linear(xs[i], L["gate"])
        agree = check(r, (tw, ids), vllm_router(r)(xs[i], logits, L["bias"]), logits, L["bias"])
        near_ties += agree["rows_differing_at_near_ties"]
        w_diff = max(w_diff, agree["max_weight_diff"])
        mine = fused_moe(xs[i], L["w1"], L["w2"], tw, ids).clone()
        ref = fused_experts(xs[i], L["w1"], L["w2"], tw, ids)
        err = max(err, rel_err(mine, ref))
        eager.append(ours(i).clone())
    if err > MAX_REL_ERR:
        raise AssertionError(f"experts differ from vLLM's on our routing: rel err {err:.3g}")
    return {"routing_rows_at_near_ties": near_ties, "routing_max_weight_diff": round(w_diff, 5),
            "experts_rel_err_vs_vllm": round(err, 5),
            "replay_rel_err_vs_eager": check_replays(ours, len(layers), outs, eager),
            "replays_checked": REPLAY_CHECKS}


def check_replays(ours: Callable, n_layers: int, outs: list, eager: list) -> float:
    """Replay ours over the layers from one CUDA graph REPLAY_CHECKS times into NaN-poisoned
    outputs; each replay must match `eager` (the default pattern's outputs, run eagerly).
    Returns the worst relative error; raises beyond MAX_REL_ERR."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_layers):
            ours(i)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(n_layers):
            ours(i)
    replay_err = 0.0
    for _ in range(REPLAY_CHECKS):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        replay_err = max(replay_err, max(rel_err(o, e) for o, e in zip(outs, eager)))
        if not replay_err <= MAX_REL_ERR:      # NaN included: an output never written
            raise AssertionError(f"graph replay differs from the eager block: rel err {replay_err:.3g}")
    del g
    return round(replay_err, 6)


def run_and_free(name: str, shape: BlockShape, ms: list[int]) -> list[dict]:
    rows = run_shape(name, shape, ms, torch.bfloat16)
    torch.cuda.empty_cache()             # the next shape's layers in a clean allocator
    return rows


def main(argv: list[str] | None = None) -> int:
    return bench_main("bench_moe_block", __doc__, SHAPES, "1,2,4,8", run_and_free, argv)


if __name__ == "__main__":
    sys.exit(main())
