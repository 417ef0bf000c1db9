"""The decode path's L2 prefetch of the down weights (config PREFETCH) against the served config
without it, per shape, format and M, with vLLM's fused_experts and the streaming floor beside.

    python bench/bench_prefetch.py --out DIR [--cells "Qwen3-30B-A3B/TP1:bf16;..."] [--ms 1,2,4,8]

Per (shape, format, M) where the served config (its tuned table or the default rule) is the
tensor-core decode path: that config with PREFETCH 0 (as served today), 1 (as the up kernel
starts) and 2 (after its K loop). Each variant is first checked on one input set, into a
NaN-poisoned output, against the float64 reference, and for bitwise equality with PREFETCH 0 (a
prefetch is a hint: the result must not change; where SPLIT_K > 1 the in-kernel fp32 atomics
need not repeat bit for bit, so mode 0 is also run twice and that check recorded beside). Then µs per layer call under CUDA-graph replay
of 8 rotating input sets, the variants timed in ROUNDS interleaved rounds (median per variant),
so drift hits them alike. Every variant is compiled for sm_90 in a process pool first. Writes
DIR/prefetch.json after every row; refuses to run without a GPU.
"""
from __future__ import annotations

import json
import statistics
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
         f"DeepSeek-V3/TP8:{BLOCK}", f"Qwen3-30B-A3B/TP1:{BLOCK}", f"Qwen3-235B-A22B/TP8:{BLOCK}",
         "Qwen3-30B-A3B/TP1:fp8_w8a8,per_token")
MODES = (0, 1, 2)
ROUNDS = 3


def log(*a: Any) -> None:
    print(*a, flush=True)


def check(prob: dict, variants: dict[int, dict]) -> dict[str, Any]:
    """Each variant's output on set 0 (into NaN) vs float64, whether it equals mode 0's, and
    whether mode 0 run twice equals itself (a split reduction's fp32 atomics add in whatever
    order the programs arrive, so a config with SPLIT_K > 1 need not repeat bit for bit)."""
    from reference import moe_reference, rel_err

    from kernels.moe.fused_moe import fused_moe

    x, tw, ids = prob["sets"][0]
    w1, w2, s1, s2 = prob["weights"]
    q = prob["fp8"]
    ref = moe_reference(x, w1, w2, tw, ids, s1, s2, block_shape=q.block_shape if q else None)
    outs, res = {}, {}
    for mode, cfg in variants.items():
        out = torch.full_like(x, float("nan"))
        fused_moe(x, w1, w2, tw, ids, fp8=q, out=out, config=cfg)
        torch.cuda.synchronize()
        outs[mode] = out
        res[f"err_vs_f64_pf{mode}"] = rel_err(out, ref)
    again = torch.full_like(x, float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=q, out=again, config=variants[0])
    res["bitwise_equal"] = all(torch.equal(outs[m], outs[0]) for m in outs)
    res["pf0_repeats_bitwise"] = torch.equal(again, outs[0])
    return res


def run_cell(name: str, fmt: str, ms: tuple[int, ...], rows: list, out: Path) -> None:
    from floor import floor_us
    from kernels_fp8 import expert_bytes

    from kernels.moe import selection
    from kernels.moe.config_schema import label, validate
    from kernels.tuning import precompile
    from kernels.tuning.timing import make_problem, time_ours, time_vllm

    E, N, K, topk = SHAPES[name]
    weights = None
    for M in ms:
        row: dict[str, Any] = {"shape": name, "format": fmt, "M": M}
        try:
            served = selection.get_config(M, E, N, K, topk, fmt)
            row.update(served_cfg=label(served), route=selection.route(E, N, K, fmt, M, topk=topk))
            if not served.get("DECODE") or served.get("GEMV"):
                row["skipped"] = "the served config is not the tensor-core decode path"
                rows.append(row)
                log(f"[prefetch] {name} {fmt} M={M}: {row['skipped']} ({row['served_cfg']})")
                continue
            base = {k: v for k, v in served.items() if k != "PREFETCH"}
            variants = {m: validate({**base, "PREFETCH": m}) for m in MODES}
            precompile.precompile([(E, N, K, topk, fmt, M, c) for c in variants.values()], log=log)
            prob = make_problem(E, N, K, topk, M, fmt, n_sets=8, device="cuda", seed=M,
                                weights=weights)
            weights = prob["weights"]
            row.update(check(prob, variants))
            times: dict[int, list[float]] = {m: [] for m in MODES}
            for _ in range(ROUNDS):
                for m, cfg in variants.items():
                    times[m].append(time_ours(prob, cfg))
            for m in MODES:
                row[f"pf{m}_us"] = statistics.median(times[m])
                row[f"pf{m}_rounds"] = [round(t, 2) for t in times[m]]
            for m in MODES[1:]:
                row[f"pf{m}_speedup"] = row["pf0_us"] / row[f"pf{m}_us"]
            try:
                row["vllm_us"] = time_vllm(prob)
            except Exception as e:  # noqa: BLE001 - vLLM's kernel cannot run the shape
                row["vllm_error"] = f"{type(e).__name__}: {e}"[:200]
            hit = sum(len(torch.unique(ids)) for _, _, ids in prob["sets"]) / len(prob["sets"])
            row["mbytes"] = hit * expert_bytes(N, K, fmt) / 1e6
            row["floor_us"] = floor_us(int(row["mbytes"] * 1e6))["floor_us"]
        except Exception as e:  # noqa: BLE001 - a failing cell is recorded, the next one runs
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        log("[prefetch] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in row.items() if not k.endswith("_rounds")))
        (out / "prefetch.json").write_text(json.dumps({"rows": rows}, indent=1))
    del weights
    torch.cuda.empty_cache()


def main() -> int:
    return cell_bench.main(__doc__, "prefetch", CELLS, "1,2,4,8", run_cell, "prefetch.json")


if __name__ == "__main__":
    sys.exit(main())
