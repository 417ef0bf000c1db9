"""Subprocess helper (TRITON_INTERPRET=0): compile the dense GEMV (moe_serve.kernels.dense.gemv) for sm_90 on
CPU (moe_serve.kernels.moe.aot) -- the default config's variant at M = 1..8 for real decode shapes, and each
config family -- and print one JSON line per compiled kernel with what its SASS shows of the K
loop (the innermost backward branch): its instructions by kind, and spills anywhere. With the
argument fp8: the FP8 GEMV (moe_serve.kernels.dense.gemv_fp8) at its default configs instead, Qwen3-30B's
QKV block-FP8 at each bucket M = 1..16 with bf16 x, and a per-channel O with fp16 x."""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.dense.gemv import MAX_M, dense_gemv  # noqa: E402
from moe_serve.kernels.dense.gemv_fp8 import FP8, dense_gemv_fp8  # noqa: E402
from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402

SHAPES = {"qwen3-qkv": (5120, 2048), "qwen3-o": (2048, 4096), "o-tp8": (2048, 512)}  # [N, K] bf16
FAMILIES = {  # name: (dtype, M, N, K, config)
    "fp16-reduced-split": (torch.float16, 8, 1024, 4096, {"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 4,
                                                          "num_warps": 4, "ACC_PAIRS": False, "PREFETCH": True}),
    "fp32-pairs-tail": (torch.float32, 3, 1000, 1000, {"BLOCK_N": 4, "BLOCK_K": 512, "SPLIT_K": 1,
                                                       "num_warps": 4, "ACC_PAIRS": True, "PREFETCH": False}),
    "bf16-bias-8warps": (torch.bfloat16, 2, 4096, 4096, {"BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_K": 2,
                                                         "num_warps": 8, "ACC_PAIRS": True, "PREFETCH": True}),
}
INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.M)


def k_loop(sass: str) -> Counter:
    """Instruction names (with their modifiers) of the innermost loop: the shortest span closed
    by a backward branch."""
    ins = [(int(a, 16), name, rest) for a, name, rest in INSTR.findall(sass)]
    spans = []
    for addr, name, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if name.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            spans.append([n for a, n, _ in ins if int(target.group(1), 16) <= a <= addr])
    return Counter(min(spans, key=len)) if spans else Counter()


FP8_CASES = {  # name: (x dtype, M, N, K, scale, block)
    **{f"qkv-block-M{m}": (torch.bfloat16, m, 5120, 2048, torch.ones(40, 16), (128, 128)) for m in (1, 2, 4, 8, 16)},
    "o-channel-fp16-M3": (torch.float16, 3, 2048, 4096, torch.ones(2048, 1), None),
}


def report(variant: str, launches: list, cache: dict) -> None:
    for (name, ck), (_, grid, _, kw) in zip(aot.compile_launches(launches, cache=cache), launches):
        sass = aot.sass(ck)
        loop = k_loop(sass)
        print(json.dumps({"variant": variant, "kernel": name, "grid": list(grid),
                          "block_m": kw["BLOCK_M"], "block_n": kw["BLOCK_N"], "split": kw["SPLIT_K"],
                          "vec": kw.get("VEC", 16), "pairs": kw["ACC_PAIRS"], "scale": kw.get("SCALE"),
                          "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
                          "loop": dict(loop)}), flush=True)


if __name__ == "__main__":
    cache: dict = {}
    if sys.argv[1:] == ["fp8"]:
        for name, (dtype, M, N, K, scale, block) in FP8_CASES.items():
            with record_launches() as launches:
                dense_gemv_fp8(torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=FP8), scale, block=block)
            report(name, launches, cache)
        sys.exit(0)
    for name, (N, K) in SHAPES.items():
        w = torch.empty(N, K, dtype=torch.bfloat16)
        for M in range(1, MAX_M + 1):
            with record_launches() as launches:
                dense_gemv(torch.empty(M, K, dtype=torch.bfloat16), w)
            report(f"{name}-M{M}", launches, cache)
    for name, (dtype, M, N, K, cfg) in FAMILIES.items():
        with record_launches() as launches:
            dense_gemv(torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=dtype),
                       torch.empty(N, dtype=dtype) if "bias" in name else None, cfg=cfg)
        report(name, launches, cache)
