"""The expert-kernel bench's compile count: Triton compiles (moe_serve.kernels.plugin.jit_monitor) while M
sweeps 1..max_m after the warm-up, ours and vLLM's `fused_experts`."""
from __future__ import annotations

import os
from typing import Any

import torch

from moe_serve.bench.experts.problem import CUDA, DEV, log, problem

def part_compiles(shape: tuple, dtype: str, max_m: int) -> dict:
    """Compiles (jit_monitor) while M sweeps 1..max_m after warm-up, ours and vLLM's."""
    from moe_serve.kernels.plugin import jit_monitor
    from moe_serve.kernels.moe.fused_moe import fused_moe
    from moe_serve.kernels.moe.moe_variants import warm_moe_variants

    E, N, K, topk = shape
    jit_monitor.install()
    res: dict[str, Any] = {"shape": shape, "dtype": dtype, "max_m": max_m,
                           "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    prob = problem(shape, max_m, dtype, 1)
    x, tw, ids = prob["sets"][0]
    w1, w2 = prob["weights"][:2]
    jit_monitor.set_phase("warmup")
    res["ours_variants"] = warm_moe_variants(E, N, K, topk, torch.bfloat16, max_m, "per_tensor" if dtype == "fp8"
                                  else None, DEV, static_act=True, verbose=False)
    before = jit_monitor.snapshot()
    jit_monitor.set_phase("serving")
    for m in range(1, max_m + 1):
        fused_moe(x[:m], w1, w2, tw[:m], ids[:m], fp8=prob["fp8"])
    snap = jit_monitor.snapshot()
    res["ours_serving_compiles"] = sum(v for (k, ph, kd), v in snap.items()
                                       if ph == "serving" and kd == "compile")
    res["ours_warmup_compiles"] = sum(v for (k, ph, kd), v in before.items() if kd == "compile")
    from moe_serve.kernels.moe import vllm_kernels

    vl = vllm_kernels.fused_experts() if CUDA else None
    if vl is not None:
        fused_experts, qcfg = vl
        quant = None
        if prob["fp8"] is not None:
            quant = qcfg(w1_scale=prob["weights"][2], w2_scale=prob["weights"][3],
                         a1_scale=prob["fp8"].a1_scale, a2_scale=prob["fp8"].a2_scale)
        jit_monitor.set_phase("vllm_warmup")
        m = 1
        while m <= max_m:
            fused_experts(x[:m], w1, w2, tw[:m], ids[:m], quant_config=quant)
            m *= 2
        jit_monitor.set_phase("vllm_serving")
        for m in range(1, max_m + 1):
            fused_experts(x[:m], w1, w2, tw[:m], ids[:m], quant_config=quant)
        snap = jit_monitor.snapshot()
        res["vllm_serving_compiles"] = sum(v for (k, ph, kd), v in snap.items()
                                           if ph == "vllm_serving" and kd == "compile")
        res["vllm_serving_by_kernel"] = {k: v for (k, ph, kd), v in snap.items()
                                         if ph == "vllm_serving" and kd == "compile"}
    jit_monitor.set_phase("warmup")
    log(f"[compiles] {res}")
    return res
