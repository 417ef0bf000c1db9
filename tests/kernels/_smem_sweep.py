"""Subprocess helper (TRITON_INTERPRET unset): every config the loader returns for the bench
shapes (tuned + untuned, bf16 + fp8) and M up to 16384 must fit sm_90's shared memory.

Prints one JSON line: {"configs": n distinct, "max_estimate": ..., "over_estimate": [...],
"compiled": [{"est", "shared", ...}] } for the `argv[1]` configs closest to the limit plus
`argv[2]` random others, compiled for sm_90 with moe_serve.kernels.moe.aot (real Triton metadata.shared)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

import torch  # noqa: E402

from moe_serve.bench.experts.shapes import TUNED, UNTUNED  # noqa: E402
from moe_serve.kernels.moe import aot, configs, selection, smem  # noqa: E402
from moe_serve.kernels.moe.align import moe_align_kernel  # noqa: E402
from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402
from moe_serve.kernels.moe.moe_gemm import topk_sum_kernel  # noqa: E402

# the Triton the shipped H200 tables were tuned with (they are refused under another)
SHIPPED_TRITON = json.loads(next(configs.CONFIG_DIR.glob("E=*.json")).read_text())["triton_version"]

MS = sorted({*range(1, 65), *configs.M_BUCKETS, 100, 300, 700, 1500, 3000, 6000, 8192, 12000,
             16384})


def measure(cfg: dict[str, Any], dtype: str, static_act: bool = True, E: int = 8, N: int = 256,
            K: int = 512, topk: int = 2, M: int = 4) -> list[tuple[int, int]]:
    """[(estimate, Triton's metadata.shared)] of the GEMM launches of cfg, compiled for sm_90
    on the CPU (needs TRITON_INTERPRET unset)."""
    wdt = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w1, w2 = torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt)
    tw = torch.empty(M, topk)
    ids = (torch.arange(M * topk) % E).reshape(M, topk).to(torch.int32)
    one = torch.ones(())
    fp8 = Fp8Scales(torch.ones(E), torch.ones(E), one if static_act else None,
                    one if static_act else None) if dtype == "fp8" else None
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, fp8=fp8, config=cfg)
    gemms = [ln for ln in launches if ln[3].get("BLOCK_N") is not None
             and ln[0] not in (topk_sum_kernel, moe_align_kernel)]
    est = smem.gemm_estimates(cfg, dtype, topk=topk)
    out = []
    for (ln, e) in zip(gemms, est):
        (_, ck), = aot.compile_launches([ln], cache={})
        out.append((e, int(ck.metadata.shared)))
    return out


def main() -> None:
    n_top, n_rand = int(sys.argv[1]), int(sys.argv[2])
    seen: dict[str, tuple] = {}
    over = []
    for name, (E, N, K, topk) in {**TUNED, **UNTUNED}.items():
        for dt in ("bf16", "fp8"):
            for M in MS:
                cfg = selection.get_config(M, E, N, K, topk, dt, "NVIDIA_H200", triton_version=SHIPPED_TRITON)
                est = max(smem.gemm_estimates(cfg, dt, topk=topk))
                if est > smem.SMEM_LIMIT:
                    over.append([name, dt, M, est])
                key = json.dumps([cfg, dt, N, K, topk], sort_keys=True)
                seen.setdefault(key, (est, cfg, dt, N, K, topk, name, M))
    items = sorted(seen.values(), key=lambda t: -t[0])
    pick = items[:n_top] + random.Random(0).sample(items[n_top:], min(n_rand, len(items) - n_top))
    compiled = []
    for est, cfg, dt, N, K, topk, name, M in pick:
        for static in ((True, False) if dt == "fp8" else (True,)):
            m = min(M, max(1, cfg["BLOCK_M"] // topk)) if cfg.get("DECODE") else 4
            for (e, real) in measure(cfg, dt, static, E=2, N=N, K=K, topk=topk, M=m):
                compiled.append({"shape": name, "dtype": dt, "static": static, "M": M,
                                 "est": e, "shared": real})
    print(json.dumps({"configs": len(items), "max_estimate": items[0][0], "over_estimate": over,
                      "compiled": compiled}))


if __name__ == "__main__":
    main()
