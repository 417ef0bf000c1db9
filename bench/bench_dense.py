"""Dense linear layers at decode: our GEMV (kernels.dense.decode_linear, its default plan) against
vLLM's GEMM on CUDA (F.linear: cuBLAS), on the attention projections and gates of whole models.

Per named weight [N, K] and M tokens: ours checked against an fp32 product (into NaN-poisoned
outputs), then both timed as CUDA-graph replays over N_SETS weights with L2 flushed before each
call (in the model every layer has its own weights), median us; with --sweep, at M = 1 also a
grid of plans around the default (which plan wins, and by how much over the default). The copy
floor of a row is the weight bytes over CEILING_TBS (the H200's measured copy ceiling). Needs a
CUDA GPU.

    python bench/bench_dense.py [--shapes qwen3-30b-a3b.qkv,...] [--m 1,2,4] [--sweep] [--out FILE]
"""
from __future__ import annotations

import itertools
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_router import bench_main  # noqa: E402
from kernels.dense.decode_linear import LinearPlan, decode_linear, plan  # noqa: E402
from kernels.tuning.timing import time_graph  # noqa: E402

SHAPES = {  # name -> (N, K) of the weight at the stated tensor parallelism
    "qwen3-30b-a3b.qkv": (5120, 2048), "qwen3-30b-a3b.o": (2048, 4096), "qwen3-30b-a3b.gate": (128, 2048),
    "mixtral-8x7b.qkv": (6144, 4096), "mixtral-8x7b.o": (4096, 4096), "mixtral-8x7b.gate": (8, 4096),
    "qwen3-235b-tp8.qkv": (1280, 4096), "qwen3-235b-tp8.o": (4096, 1024),
    "glm-4.5-air-tp2.qkv": (7168, 4096), "glm-4.5-air-tp2.o": (4096, 6144),
    "deepseek-v3-tp8.q_a": (1536, 7168), "deepseek-v3-tp8.kv_a": (576, 7168),
    "deepseek-v3-tp8.q_b": (3072, 1536), "deepseek-v3-tp8.o": (7168, 2048),
    "deepseek-v3-tp8.mlp_up": (4608, 7168), "deepseek-v3-tp8.mlp_down": (7168, 2304),
}
N_SETS = 4
CEILING_TBS = 4.22
MAX_REL_ERR = 1e-2          # bf16 output of an fp32-accumulated product


def sweep_plans(base: LinearPlan) -> list[LinearPlan]:
    """Plans around the default: tile widths, K chunk, one split fewer / more, stages."""
    splits = sorted({max(1, base.SPLIT_K // 2), base.SPLIT_K, base.SPLIT_K * 2})
    return [replace(base, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_stages=st)
            for bn, bk, s, st in itertools.product((32, 64, 128), (128, 256), splits, (3, 4))]


def run_shape(name: str, shape: tuple[int, int], ms: list[int], sweep: bool) -> list[dict]:
    N, K = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5 for _ in range(N_SETS)]
    floor_us = N * K * 2 / (CEILING_TBS * 1e12) * 1e6
    rows = []
    for M in ms:
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(N_SETS)]
        outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(N_SETS)]
        base = plan(M, N, K)
        cands = [base] + ([p for p in sweep_plans(base) if p != base] if sweep and M == 1 else [])
        timed, skipped = [], 0
        for cfg in cands:
            poisoned = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                decode_linear(xs[0], ws[0], out=poisoned, cfg=cfg)
            except OutOfResources:          # a swept plan whose stages do not fit shared memory
                if cfg == base:
                    raise
                skipped += 1
                continue
            ref = xs[0].float() @ ws[0].float().T
            err = float((poisoned.float() - ref).norm() / ref.norm())
            if not err <= MAX_REL_ERR:
                raise AssertionError(f"{name} M={M} {cfg}: rel err {err:.3g}")
            us = time_graph(lambda i: decode_linear(xs[i], ws[i], out=outs[i], cfg=cfg), N_SETS, flush_l2=True)
            timed.append((us, cfg, err))
        cublas = time_graph(lambda i: torch.nn.functional.linear(xs[i], ws[i]), N_SETS, flush_l2=True)
        ours_us, _, err = timed[0]
        best_us, best, _ = min(timed, key=lambda t: t[0])
        row = {"shape": name, "N": N, "K": K, "M": M, "plan": asdict(base), "ours_us": round(ours_us, 2),
               "cublas_us": round(cublas, 2), "speedup": round(cublas / ours_us, 3),
               "floor_us": round(floor_us, 2), "ours_pct_floor": round(100 * floor_us / ours_us, 1),
               "cublas_pct_floor": round(100 * floor_us / cublas, 1), "rel_err": round(err, 5)}
        if len(timed) > 1:
            row.update(best_plan=asdict(best), best_us=round(best_us, 2), plans_timed=len(timed),
                       plans_skipped=skipped, best_over_default=round(ours_us / best_us, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    return bench_main("bench_dense", __doc__, SHAPES, "1,2,4", run_shape, argv,
                      {"sweep": "at M = 1 also time a grid of plans around the default"})


if __name__ == "__main__":
    sys.exit(main())
