"""Why our FP8 aligned kernel trails vLLM's on the Mixtral-8x7B TP=2 shard (E=8, N=7168, K=4096).

    python bench/investigations/fp8_large_n.py --out /root/out/fp8_large_n    # H200

The tuned table (kernels/moe/configs) measured 0.84-0.88x vLLM's `fused_experts` at M = 12..192
although the search started from vLLM's config. This times ours, under CUDA-graph replay, over
a grid around the shipped config of the M bucket (GEMM1 BLOCK_N x FUSE_GU x num_stages x
A_PREQUANT; the GEMM2 axes were covered by the run in tune_ab_session/fp8_large_n.json) and
around vLLM's config mapped to ours (kernels.moe.heuristics.from_vllm_config; the dicts below are vLLM 0.26's
E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json entries), and writes every row
(config, us) to --out/rows.json. No vLLM needed: the comparison point is the vLLM time measured
in bench/results/2026-12-01/tune_ab_session/validation.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

E, N, K, TOPK = 8, 7168, 4096, 2
VLLM_CFG = {  # vLLM 0.26, E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json
    64: {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
         "num_warps": 4, "num_stages": 4},
    256: {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16,
          "num_warps": 4, "num_stages": 3},
}


def grid(base: dict) -> list[dict]:
    """base and its GEMM1 neighbours: BLOCK_N x FUSE_GU x stages x A_PREQUANT (GEMM2 as in base:
    A_PREQUANT changes only GEMM1's A operand)."""
    out = []
    for bn1, fgu, st, pq in itertools.product((64, 128), (True, False), (3, 4), (False, True)):
        out.append({**base, "BLOCK_N": bn1, "FUSE_GU": fgu, "num_stages": st, "A_PREQUANT": pq})
    return out


def main() -> int:
    import torch

    from kernels.moe import configs, heuristics, selection
    from kernels.tuning import precompile, tune
    from kernels.moe.config_schema import label, validate
    from kernels.tuning.timing import make_problem, time_ours

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="64,256")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = configs.device_name()
    rows, weights = [], None
    for M in (int(m) for m in a.ms.split(",")):
        shipped = selection.get_config(M, E, N, K, TOPK, "fp8", dev)
        starts = {"shipped": shipped, "vllm-mapped": heuristics.from_vllm_config(VLLM_CFG[M])}
        cands: dict[str, dict] = {}                  # key: the whole config (labels omit stages)
        for name, s in starts.items():
            for c in [validate(s)] + grid(validate(s)):
                if not tune.legal(c, N, K, TOPK, "fp8"):
                    continue
                cands.setdefault(json.dumps(c, sort_keys=True), c)
        t0 = time.perf_counter()
        precompile.precompile([(E, N, K, TOPK, "fp8", M, c) for c in cands.values()])
        print(f"M={M}: {len(cands)} configs compiled in {time.perf_counter() - t0:.0f}s", flush=True)
        prob = make_problem(E, N, K, TOPK, M, "fp8", n_sets=8, device="cuda", seed=M, weights=weights)
        weights = prob["weights"]
        for key, c in cands.items():
            lab = f"{label(c)}/st{c['num_stages']}"
            try:
                us = time_ours(prob, c, replays=10)
            except Exception as e:  # noqa: BLE001 - OutOfResources etc.: recorded, not fatal
                rows.append({"M": M, "cfg": lab, "error": f"{type(e).__name__}: {e}"[:200]})
                torch.cuda.synchronize()
                continue
            tag = [n for n, s in starts.items() if json.dumps(validate(s), sort_keys=True) == key]
            rows.append({"M": M, "cfg": lab, "us": us, "start": tag[0] if tag else None, "config": c})
        best = sorted((r for r in rows if r["M"] == M and "us" in r), key=lambda r: r["us"])
        for r in best[:6] + [r for r in best if r["start"]]:
            print(f"M={M} {r['us']:8.1f} us  {r['cfg']}  {r['start'] or ''}", flush=True)
        (a.out / "rows.json").write_text(json.dumps(rows, indent=1))
    precompile.shutdown_pool()
    return 0


if __name__ == "__main__":
    sys.exit(main())
