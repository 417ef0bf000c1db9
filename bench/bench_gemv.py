"""The decode path on CUDA cores (kernels.moe.moe_gemv) against the tensor-core decode path as served
and vLLM's fused_experts, per shape, format and M, with the streaming floor of the bytes read.

    python bench/bench_gemv.py --out DIR [--cells "Qwen3-30B-A3B/TP1:bf16;..."] [--ms 1,2,4]

Per (shape, format, M): ours as served (its tuned table or default rule), the GEMV seed
(heuristics.gemv_config), then a coordinate walk (up kernel tiles and warps with the seed's down
kernel, then the down kernel's tiles and splits with the best up kernel); µs per layer call under
CUDA-graph replay of 8 rotating input sets (weights generated once per shape and format). Before
timing, the walk's best config is checked on one input set, into a NaN-poisoned output, against
the float64 reference (FP8: dequantized weights, float activations, as the GEMV computes) and
against the served path. Every variant is compiled for sm_90 in a process pool first. Writes
DIR/gemv.json after every row; refuses to run without a GPU.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests" / "kernels")]

import torch  # noqa: E402

import cell_bench  # noqa: E402
from kernels.tuning.named_shapes import TUNED, UNTUNED  # noqa: E402

SHAPES = {**TUNED, **UNTUNED, "Mixtral-8x7B/TP1": (8, 14336, 4096, 2)}
BLOCK = "fp8_w8a8,block_shape=[128,128]"
CELLS = ("Qwen3-30B-A3B/TP1:bf16", "Mixtral-8x7B/TP1:bf16", "Qwen3-235B-A22B/TP8:bf16",
         "DeepSeek-V3/TP8:bf16", "Mixtral-8x7B/TP8:bf16", f"Qwen3-30B-A3B/TP1:{BLOCK}",
         "Qwen3-30B-A3B/TP1:fp8_w8a8,per_token", f"DeepSeek-V3/TP8:{BLOCK}", "Mixtral-8x7B/TP8:fp8")
UP_WALK = ((4, 512, 4), (8, 512, 4), (16, 512, 4), (32, 512, 4), (16, 256, 4), (16, 1024, 4),
           (8, 1024, 4), (16, 512, 8))                            # (BLOCK_N, BLOCK_K, num_warps)
DOWN_WALK = ((8, 256, 1), (8, 256, 2), (8, 256, 4), (8, 256, 8), (4, 256, 2), (16, 256, 2),
             (8, 512, 2), (16, 512, 4))                           # (BLOCK_N, BLOCK_K, SPLIT_K)


def log(*a: Any) -> None:
    print(*a, flush=True)


def _up(cfg: dict, bn: int, bk: int, warps: int) -> dict:
    return {**cfg, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}


def _down(cfg: dict, bn: int, bk: int, split: int) -> dict:
    return {**cfg, "DOWN": {**cfg["DOWN"], "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}}


def walk_candidates(seed: dict, fmt: str, N: int, K: int, topk: int) -> tuple[list, list]:
    """(up candidates, down candidates) of the walk, normalised and legal for the format."""
    from kernels.tuning.candidates import legal_unique

    return (legal_unique([_up(seed, *u) for u in UP_WALK], [], N, K, topk, fmt),
            legal_unique([_down(seed, *d) for d in DOWN_WALK], [], N, K, topk, fmt))


def check(prob: dict, cfg: dict, served: dict) -> dict:
    """rel. errors of cfg's output on set 0 vs float64 and vs the served config's output."""
    from reference import moe_reference, rel_err

    from kernels.moe.fused_moe import fused_moe

    x, tw, ids = prob["sets"][0]
    w1, w2, s1, s2 = prob["weights"]
    q = prob["fp8"]
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=q, out=out, config=cfg)
    ref_served = fused_moe(x, w1, w2, tw, ids, fp8=q, config=served)
    ref = moe_reference(x, w1, w2, tw, ids, s1, s2, block_shape=q.block_shape if q else None)
    return {"err_vs_f64": rel_err(out, ref), "err_vs_served": rel_err(out, ref_served.double()),
            "served_err_vs_f64": rel_err(ref_served, ref)}


def run_cell(name: str, fmt: str, ms: tuple[int, ...], rows: list, out: Path) -> None:
    from floor import floor_us
    from kernels_fp8 import expert_bytes

    from kernels.moe import heuristics, selection
    from kernels.moe.config_schema import label
    from kernels.tuning import precompile
    from kernels.tuning.timing import make_problem, time_ours, time_vllm

    E, N, K, topk = SHAPES[name]
    weights = None
    for M in ms:
        if M * topk > 32:
            continue
        row: dict[str, Any] = {"shape": name, "format": fmt, "M": M}
        try:
            served = selection.get_config(M, E, N, K, topk, fmt)
            seed = heuristics.gemv_config(M, E, N, K, topk, fmt)
            ups, downs = walk_candidates(seed, fmt, N, K, topk)
            precompile.precompile([(E, N, K, topk, fmt, M, c) for c in [served, *ups, *downs]], log=log)
            prob = make_problem(E, N, K, topk, M, fmt, n_sets=8, device="cuda", seed=M,
                                weights=weights)
            weights = prob["weights"]
            row.update(served_cfg=label(served), route=selection.route(E, N, K, fmt, M, topk=topk))
            row["served_us"] = time_ours(prob, served)
            best = (time_ours(prob, seed), seed)
            row["seed_cfg"], row["seed_us"] = label(seed), best[0]
            for c in ups:
                best = min(best, (time_ours(prob, c), c), key=lambda tc: tc[0])
            for c in downs:
                c = {**best[1], "DOWN": c["DOWN"]}
                best = min(best, (time_ours(prob, c), c), key=lambda tc: tc[0])
            row["gemv_cfg"], row["gemv_us"] = label(best[1]), best[0]
            row.update(check(prob, best[1], served))
            row["vllm_us"] = time_vllm(prob)
            hit = sum(len(torch.unique(ids)) for _, _, ids in prob["sets"]) / len(prob["sets"])
            row["mbytes"] = hit * expert_bytes(N, K, fmt) / 1e6
            row["floor_us"] = floor_us(int(row["mbytes"] * 1e6))["floor_us"]
            row["gemv_vs_served"] = row["served_us"] / row["gemv_us"]
            if row["vllm_us"]:
                row["gemv_vs_vllm"] = row["vllm_us"] / row["gemv_us"]
                row["served_vs_vllm"] = row["vllm_us"] / row["served_us"]
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        log("[gemv] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items()))
        (out / "gemv.json").write_text(json.dumps({"rows": rows}, indent=1))
    del weights
    torch.cuda.empty_cache()


def main() -> int:
    return cell_bench.main(__doc__, "gemv", CELLS, "1,2,4", run_cell, "gemv.json")


if __name__ == "__main__":
    sys.exit(main())
