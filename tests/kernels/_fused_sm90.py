"""Subprocess helper (TRITON_INTERPRET=0): compile the fused kernels (moe_serve.kernels.fused) for sm_90 on
CPU (moe_serve.kernels.moe.aot) and print one JSON line per compiled kernel: register spills, and for the
norm GEMV what its innermost loop (the K loop) holds. Variants: Qwen3-30B-A3B's QKV at its
serving configs for M = 1, 2, 8, 16 (bf16; with and without a residual), its router gate
with h written, fp16 / fp32 with split K; the row norm; Q/K norm + RoPE with and without the
cache write (neox; GPT-J partial)."""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moe_serve.kernels.fused.norm_gemv import norm_gemv  # noqa: E402
from moe_serve.kernels.fused.qk_norm_rope import qk_norm_rope  # noqa: E402
from moe_serve.kernels.fused.rms_norm import add_rms_norm  # noqa: E402
from moe_serve.kernels.moe import aot  # noqa: E402
from moe_serve.kernels.moe.launch import record_launches  # noqa: E402
from tests.kernels._dense_sm90 import INSTR  # noqa: E402

BF16 = torch.bfloat16
SPLIT = {"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 4, "num_warps": 4, "ACC_PAIRS": False, "PREFETCH": True}
NORM_GEMV = {  # name: (dtype, M, N, K, residual, write_h, exact_h, config or None: the serving config)
    **{f"qwen3-qkv-M{M}": (BF16, M, 5120, 2048, M != 2, False, True, None) for M in (1, 2, 8, 16)},
    **{f"qwen3-qkv-M{M}-folded": (BF16, M, 5120, 2048, True, False, False, None) for M in (1, 8)},
    "qwen3-gate-h": (BF16, 1, 128, 2048, True, True, True, None),
    "fp16-split-h": (torch.float16, 3, 1024, 4096, True, True, True, SPLIT),
    "fp32-split-pairs": (torch.float32, 6, 1024, 4096, True, False, True,
                         {**SPLIT, "BLOCK_N": 2, "BLOCK_K": 512, "ACC_PAIRS": True}),
}
QK = {  # name: (dtype, Hq, Hkv, D, rot_dim, neox, cache)
    "qwen3-rope-cache": (BF16, 32, 4, 128, 128, True, True),
    "fp16-gptj-partial-cache": (torch.float16, 8, 2, 64, 32, False, True),
}


def k_loop(sass: str) -> Counter:
    """Instruction names (with their modifiers) of the loop with the most FFMAs: the span of
    each backward branch, innermost spans only (the prologue's row loop is one too)."""
    ins = [(int(a, 16), name, rest) for a, name, rest in INSTR.findall(sass)]
    spans = []
    for addr, name, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if name.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            spans.append(Counter(n for a, n, _ in ins if int(target.group(1), 16) <= a <= addr))
    return max(spans, key=lambda c: c["FFMA"]) if spans else Counter()


def report(variant: str, launches: list, cache: dict, loop: bool) -> None:
    for (name, ck), (_, grid, _, kw) in zip(aot.compile_launches(launches, cache=cache), launches):
        sass = aot.sass(ck)
        print(json.dumps({"variant": variant, "kernel": name, "grid": list(grid),
                          "block_m": kw.get("BLOCK_M"), "block_n": kw.get("BLOCK_N"), "vec": kw.get("VEC"),
                          "pairs": kw.get("ACC_PAIRS"), "exact_h": kw.get("EXACT_H"),
                          "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
                          "narrow_loads": aot.global_loads(sass)["narrow"],
                          "loop": dict(k_loop(sass)) if loop else {}}), flush=True)


if __name__ == "__main__":
    cache: dict = {}
    for name, (dtype, M, N, K, residual, write_h, exact_h, cfg) in NORM_GEMV.items():
        x = torch.empty(M, K, dtype=dtype)
        with record_launches() as launches:
            norm_gemv(x, torch.empty_like(x) if residual else None, torch.empty(K, dtype=dtype), 1e-6,
                      torch.empty(N, K, dtype=dtype), write_h=write_h, cfg=cfg, exact_h=exact_h)
        report(name, launches, cache, loop=True)
    with record_launches() as launches:
        add_rms_norm(torch.empty(64, 2048, dtype=BF16), torch.empty(64, 2048, dtype=BF16),
                     torch.empty(2048, dtype=BF16), 1e-6)
    report("rows-bf16", launches, cache, loop=False)
    for name, (dtype, Hq, Hkv, D, rot, neox, with_cache) in QK.items():
        T = 4
        kv = (torch.empty(16, 16, Hkv, D, dtype=dtype), torch.empty(16, 16, Hkv, D, dtype=dtype),
              torch.zeros(T, dtype=torch.int64)) if with_cache else None
        with record_launches() as launches:
            qk_norm_rope(torch.empty(T, (Hq + 2 * Hkv) * D, dtype=dtype), torch.zeros(T, dtype=torch.int64),
                         torch.empty(D, dtype=dtype), torch.empty(D, dtype=dtype), 1e-6,
                         torch.empty(64, rot, dtype=dtype), Hq, Hkv, D, rot, neox, kv)
        report(name, launches, cache, loop=False)
