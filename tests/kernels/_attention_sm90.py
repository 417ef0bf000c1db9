"""Subprocess helper (TRITON_INTERPRET=0): compile the decode attention kernel
(moe_serve.kernels.attention.decode) for sm_90 on CPU (moe_serve.kernels.moe.aot) and print one JSON
line per variant: register spills, the MMA kind, whether the combine's atomic is there, how many
16-byte and 2-byte global loads it has, and the kernels the launches compiled (one per model: the
split count and sequences are not specialized). Variants: Qwen3-30B-A3B's heads (bf16, 32 + 4 x 128) at B = 1 with 32 splits and at
B = 8 with 4; fp16 G = 8 x 64; fp32 (IEEE dots)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.attention.decode import decode_attention  # noqa: E402
from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402

VARIANTS = {  # name: (dtype, B, Hq, Hkv, D, splits)
    "qwen3-bf16-B1": (torch.bfloat16, 1, 32, 4, 128, 32),
    "qwen3-bf16-B8": (torch.bfloat16, 8, 32, 4, 128, 4),
    "fp16-G8-D64": (torch.float16, 2, 16, 2, 64, 8),
    "fp32-ieee": (torch.float32, 1, 8, 2, 128, 16),
}

if __name__ == "__main__":
    cache: dict = {}
    for name, (dtype, B, Hq, Hkv, D, splits) in VARIANTS.items():
        kc = torch.empty(64, 16, Hkv, D, dtype=dtype)
        with record_launches() as launches:
            decode_attention(torch.empty(B, Hq, D, dtype=dtype), kc, torch.empty_like(kc),
                             torch.zeros(B, 8, dtype=torch.int32), torch.ones(B, dtype=torch.int32), 0.1,
                             num_splits=splits)
        for (kernel, compiled), (_, grid, _, _) in zip(aot.compile_launches(launches, cache=cache), launches):
            sass = aot.sass(compiled)
            print(json.dumps({"variant": name, "kernel": kernel, "grid": list(grid),
                              "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)), "mma": aot.mma_kind(sass),
                              "atomic": bool(re.search(r"\b(?:ATOMG|ATOM|RED)\b", sass)),
                              **{f"{k}_loads": n for k, n in aot.global_loads(sass).items()},
                              "compiled": len(cache[kernel].device_caches[0][0])}), flush=True)
