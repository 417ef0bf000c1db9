"""Subprocess helper (TRITON_INTERPRET=0): compile the router's variants (moe_serve.kernels.moe.router_topk),
two of them adding the expert load (one with the sort top-k), and the expert count kernel (moe_serve.kernels.moe.expert_count) for
sm_90 on CPU (moe_serve.kernels.moe.aot) and print one JSON line per compiled kernel (with its count
of 16-byte global loads)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402
from moe_serve.kernels.moe.expert_count import count_experts_triton  # noqa: E402
from moe_serve.kernels.moe.router_topk import router_topk  # noqa: E402

VARIANTS = {  # name: (M, E, K, topk, scoring, bias, count, top-k method)
    "qwen3-decode-split": (1, 128, 2048, 8, "softmax", False, False, "rounds"),
    "qwen3-decode-split-counting": (1, 128, 2048, 8, "softmax", False, True, "rounds"),
    "qwen3-decode-split-sort": (1, 128, 2048, 8, "softmax", False, True, "sort"),
    "mixtral-decode-split": (4, 8, 4096, 2, "softmax", False, False, "rounds"),
    "deepseek-sigmoid-bias": (2, 256, 7168, 8, "sigmoid", True, False, "rounds"),
    "prefill-one-program": (512, 128, 2048, 8, "softmax", False, False, "rounds"),
    "kimi-one-program": (256, 384, 7168, 8, "sigmoid", True, False, "rounds"),
}
COUNTS = {"count-int32-ids": torch.int32, "count-int64-ids-eplb": torch.int64}  # name: topk_ids dtype

if __name__ == "__main__":
    cache: dict = {}
    for name, (M, E, K, topk, scoring, bias, count, method) in VARIANTS.items():
        x, w = torch.empty(M, K, dtype=torch.bfloat16), torch.empty(E, K, dtype=torch.bfloat16)
        counts = (torch.zeros(E, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)) if count else None
        with record_launches() as launches:
            router_topk(x, w, topk, scoring, bias=torch.zeros(E) if bias else None, counts=counts, method=method)
        for (kname, ck), (_, grid, _, kw) in zip(aot.compile_launches(launches, cache=cache), launches):
            print(json.dumps({"variant": name, "kernel": kname, "grid": list(grid), "count": kw["COUNT"],
                              "one_program": kw["ONE_PROGRAM"], "smem": int(ck.metadata.shared),
                              "launch_pdl": bool(kw.get("launch_pdl")),
                              "wide_loads": aot.global_loads(aot.sass(ck))["wide"],
                              "gdc": [i for i in ("griddepcontrol.launch_dependents", "griddepcontrol.wait")
                                      if i in ck.asm["ptx"]]}), flush=True)
    for name, dtype in COUNTS.items():
        with record_launches() as launches:
            count_experts_triton(torch.zeros(64, 8, dtype=dtype), torch.zeros(128, dtype=torch.int64),
                                 torch.zeros(1, dtype=torch.int32), out_of_range=torch.zeros(1, dtype=torch.int64),
                                 expert_map=torch.zeros(144, dtype=torch.int64) if "eplb" in name else None)
        for (kname, ck), (_, grid, _, _) in zip(aot.compile_launches(launches, cache=cache), launches):
            print(json.dumps({"variant": name, "kernel": kname, "grid": list(grid),
                              "atomics": len(re.findall(r"\b(?:atom|red)\.global", ck.asm["ptx"]))}), flush=True)
