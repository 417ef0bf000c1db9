"""Subprocess helper (TRITON_INTERPRET unset): every config the loader returns for the bench
shapes (tuned + untuned, bf16 + fp8) and M up to 16384 must fit sm_90's shared memory.

Prints one JSON line: {"configs": n distinct, "max_estimate": ..., "over_estimate": [...],
"compiled": [{"est", "shared", ...}] } for the `argv[1]` configs closest to the limit plus
`argv[2]` random others, compiled for sm_90 with kernels.aot (real Triton metadata.shared)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from shapes import TUNED, UNTUNED  # noqa: E402

from kernels import configs, smem  # noqa: E402

MS = sorted({*range(1, 65), *configs.M_BUCKETS, 100, 300, 700, 1500, 3000, 6000, 8192, 12000,
             16384})


def main() -> None:
    n_top, n_rand = int(sys.argv[1]), int(sys.argv[2])
    seen: dict[str, tuple] = {}
    over = []
    for name, (E, N, K, topk) in {**TUNED, **UNTUNED}.items():
        for dt in ("bf16", "fp8"):
            for M in MS:
                cfg = configs.get_config(M, E, N, K, topk, dt, "NVIDIA_H200")
                est = max(smem.gemm_estimates(cfg, dt))
                if est > smem.SMEM_LIMIT:
                    over.append([name, dt, M, est])
                key = json.dumps([cfg, dt, N, K, topk], sort_keys=True)
                seen.setdefault(key, (est, cfg, dt, N, K, topk, name, M))
    items = sorted(seen.values(), key=lambda t: -t[0])
    pick = items[:n_top] + random.Random(0).sample(items[n_top:], min(n_rand, len(items) - n_top))
    compiled = []
    for est, cfg, dt, N, K, topk, name, M in pick:
        for static in ((True, False) if dt == "fp8" else (True,)):
            for (e, real) in smem.measure(cfg, dt, static, E=2, N=N, K=K, topk=topk, M=4):
                compiled.append({"shape": name, "dtype": dt, "static": static, "M": M,
                                 "est": e, "shared": real})
    print(json.dumps({"configs": len(items), "max_estimate": items[0][0], "over_estimate": over,
                      "compiled": compiled}))


if __name__ == "__main__":
    main()
