"""The MoE router at decode: our one launch (kernels.moe.router_topk) against vLLM's two (the
gate GEMM as the model runs it, F.linear in the gate's dtype, then vLLM's fused top-k op).

Per named router shape and M: both checked against each other on the GPU (the same experts
chosen up to near-ties of the bf16 logits, the weights within 1e-2), then timed as CUDA-graph
replays over rotating input sets (a different gate per set, as each layer has its own), median
us and vLLM's time / ours. Needs a CUDA GPU and vLLM.

    python bench/bench_router.py [--shapes qwen3-30b-a3b,...] [--m 1,2,4,8,16] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.moe.router_topk import router_topk  # noqa: E402
from kernels.tuning.timing import time_graph  # noqa: E402


@dataclass(frozen=True)
class RouterShape:
    """A model's router: E experts over hidden size K, its top-k and scoring (config.json)."""

    E: int
    K: int
    topk: int
    scoring: str = "softmax"
    renormalize: bool = True
    bias: bool = False               # e_score_correction_bias (choice only)
    scaling: float = 1.0             # routed_scaling_factor


SHAPES = {
    "qwen3-30b-a3b": RouterShape(128, 2048, 8),
    "qwen3-235b-a22b": RouterShape(128, 4096, 8),
    "mixtral-8x7b": RouterShape(8, 4096, 2),
    "glm-4.5-air": RouterShape(128, 4096, 8, "sigmoid", True, True, 1.0),
}
N_SETS = 16
NEAR_TIE_LOGIT = 0.05        # bf16 logits of unit scale round by <= 2^-8 relative
MAX_WEIGHT_DIFF = 1e-2


def vllm_router(shape: RouterShape):
    """vLLM's top-k for this shape: (hidden, logits) -> (weights, ids)."""
    if shape.bias:
        from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import fused_topk_bias
        return lambda x, logits, bias: fused_topk_bias(x, logits, shape.scoring, bias, shape.topk,
                                                        shape.renormalize,
                                                        routed_scaling_factor=shape.scaling)[:2]
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    return lambda x, logits, bias: fused_topk(x, logits, shape.topk, shape.renormalize,
                                              scoring_func=shape.scoring)[:2]


def check(shape: RouterShape, ours: tuple, theirs: tuple, logits: torch.Tensor,
          bias: torch.Tensor | None = None) -> dict:
    """Rows whose expert sets differ (allowed only at a near-tie of the choice key on vLLM's bf16
    logits: the logit itself for softmax, sigmoid + bias for sigmoid) and the largest weight
    difference on the rows that agree."""
    (w, ids), (vw, vids) = ours, theirs
    o, v = ids.long().sort(-1), vids.long().sort(-1)
    same = (o.values == v.values).all(-1)
    key, tie = logits.float(), NEAR_TIE_LOGIT
    if shape.scoring == "sigmoid":   # sigmoid' <= 1/4
        key, tie = key.sigmoid() + (bias if bias is not None else 0.0), NEAR_TIE_LOGIT / 4
    kth = key.topk(shape.topk + 1, -1).values                            # [M, topk + 1]
    near_tie = (kth[:, -2] - kth[:, -1]).abs() < tie
    if not bool((same | near_tie).all()):
        raise AssertionError(f"expert sets differ away from a near-tie: {ids.tolist()} vs {vids.tolist()}")
    diff = (w.gather(1, o.indices) - vw.float().gather(1, v.indices)).abs()[same]
    return {"rows_differing_at_near_ties": int((~same).sum()),
            "max_weight_diff": float(diff.max()) if diff.numel() else 0.0}


def run_shape(name: str, shape: RouterShape, ms: list[int], dtype: torch.dtype) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gates = [torch.randn(shape.E, shape.K, device="cuda", dtype=dtype, generator=g) / shape.K ** 0.5
             for _ in range(N_SETS)]
    bias = torch.rand(shape.E, device="cuda", generator=g) * 0.2 if shape.bias else None
    theirs = vllm_router(shape)
    rows = []
    for M in ms:
        xs = [torch.randn(M, shape.K, device="cuda", dtype=dtype, generator=g) for _ in range(N_SETS)]

        def ours(i: int) -> tuple:
            return router_topk(xs[i], gates[i], shape.topk, shape.scoring, shape.renormalize,
                               bias=bias, scaling=shape.scaling)

        def vllm(i: int) -> tuple:
            logits = torch.nn.functional.linear(xs[i], gates[i])
            return theirs(xs[i], logits, bias)

        agree = check(shape, ours(0), vllm(0), torch.nn.functional.linear(xs[0], gates[0]), bias)
        if agree["max_weight_diff"] > MAX_WEIGHT_DIFF:
            raise AssertionError(f"{name} M={M}: weights differ by {agree['max_weight_diff']:.3g}")
        t_ours, t_vllm = time_graph(ours, N_SETS), time_graph(vllm, N_SETS)
        rows.append({"shape": name, **asdict(shape), "M": M, "ours_us": round(t_ours, 2),
                     "vllm_us": round(t_vllm, 2), "speedup": round(t_vllm / t_ours, 3), **agree})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_main(prog: str, doc: str, shapes: dict[str, Any], default_m: str,
               run: Callable[[str, Any, list[int]], list[dict]], argv: list[str] | None) -> int:
    """The command line of a GPU bench over named shapes and token counts: --shapes, --m, --out
    (the rows as JSON); 2 without a CUDA GPU or for an unknown shape."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(shapes), help=f"comma list of {sorted(shapes)}")
    ap.add_argument("--m", default=default_m, help="token counts, comma list")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU", file=sys.stderr)
        return 2
    unknown = sorted(set(args.shapes.split(",")) - set(shapes))
    if unknown:
        print(f"{prog}: unknown shapes {unknown}; known: {sorted(shapes)}", file=sys.stderr)
        return 2
    ms = [int(m) for m in args.m.split(",")]
    rows = [r for name in args.shapes.split(",") for r in run(name, shapes[name], ms)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("bench_router", __doc__, SHAPES, "1,2,4,8,16",
                      lambda name, shape, ms: run_shape(name, shape, ms, torch.bfloat16), argv)


if __name__ == "__main__":
    sys.exit(main())
