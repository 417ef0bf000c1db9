"""Launcher of the two-launch small-batch (decode) path, kernels.moe_decode: GEMM1 + SiLU into
act [T, N], then GEMM2 + routed weight + top-k sum into out. With fp8 hidden states in floats and
A_PREQUANT, one quantize-once launch comes first; act is quantized in the up kernel's epilogue
where a tile holds what its scale needs (fp8_scales.gemm2_plan), else by the down kernel on load.
No host sync, buffers sized from shapes only: CUDA-graph capturable."""
from __future__ import annotations

from typing import Any

import torch
import triton

from kernels import configs, fp8_scales
from kernels.config_schema import prequant
from kernels.fp8_scales import FP8, INTERPRET, Fp8Scales, block_stride, scale_strides
from kernels.launch import launch
from kernels.moe_decode import moe_decode_down_kernel, moe_decode_up_kernel


def fused_moe_decode(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tw: torch.Tensor,
                     ids: torch.Tensor, fp8: Fp8Scales | None, on_input: bool, out: torch.Tensor,
                     cfg: dict[str, Any]) -> torch.Tensor:
    """The decode path for x [M, K] (kernels.fused_moe.fused_moe checked the shapes)."""
    M, K = x.shape
    E, N = w1.shape[0], w1.shape[1] // 2
    topk = ids.shape[1]
    T = M * topk
    if T > cfg["BLOCK_M"]:
        raise ValueError(f"decode config BLOCK_M={cfg['BLOCK_M']} < M*topk={T}")
    ids = ids.contiguous()
    down = configs.down_config(cfg)
    w1s, w1_mode, w2s, w2_mode = fp8_scales.weight_scales(fp8, E, N, K)
    x1, a1s, a_mode1 = fp8_scales.gemm1_input(x, fp8, prequant(cfg))
    c_quant, a_mode2 = fp8_scales.gemm2_plan(fp8, cfg["BLOCK_N"])
    act = torch.empty((T, N), dtype=FP8 if c_quant else out.dtype, device=x.device)  # [T, N]
    a2s = fp8.a2_scale if fp8 is not None else None
    if c_quant == 2:
        a2s = torch.empty((T, triton.cdiv(N, fp8.group_k)), dtype=torch.float32, device=x.device)
    gn, gk = (fp8.group_n, fp8.group_k) if fp8 is not None else (0, 0)
    dummy = tw
    pdl = bool(cfg.get("PDL")) and not INTERPRET
    ws1 = w1s if w1s is not None else dummy
    se1, sn1, sk1 = block_stride(ws1, w1_mode)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch(
        moe_decode_up_kernel, (T, triton.cdiv(N, bn)),
        x1, w1, act, ids, tw, a1s if a1s is not None else dummy, ws1,
        a2s if c_quant else dummy,
        N, K, T,
        x1.stride(0), x1.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        act.stride(0), act.stride(1), se1, sn1,
        *scale_strides(a1s), sk1, *(scale_strides(a2s) if c_quant == 2 else (0, 0)),
        TOPK=topk, MUL_ROUTED=on_input, A_MODE=a_mode1, W_SCALE=w1_mode, C_QUANT=c_quant,
        EVEN_K=K % bk == 0, SWAP_AB=cfg["SWAP_AB"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
        BLOCK_K=bk, FP8_PREROUND=INTERPRET and (a_mode1 in (2, 3, 6) or c_quant > 0),
        USE_PDL=pdl, GROUP_N=gn, GROUP_K=gk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    ws2 = w2s if w2s is not None else dummy
    se2, sk2, sn2 = block_stride(ws2, w2_mode)
    bn2, bk2 = down["BLOCK_N"], down["BLOCK_K"]
    launch(
        moe_decode_down_kernel, (M * triton.cdiv(K, bn2),),
        act, w2, out, ids, tw, a2s if a2s is not None else dummy, ws2,
        K, N, M,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), se2, sk2,
        *(scale_strides(a2s) if a_mode2 == 5 else (0, 0)), sn2,
        TOPK=topk, MUL_ROUTED=not on_input, A_MODE=a_mode2, W_SCALE=w2_mode,
        EVEN_N=N % bk2 == 0, SWAP_AB=down["SWAP_AB"],
        BLOCK_M=max(16, triton.next_power_of_2(topk)), BLOCK_N=bn2, BLOCK_K=bk2,
        FP8_PREROUND=INTERPRET and a_mode2 in (2, 3, 6), USE_PDL=pdl,
        GROUP_N=gn, GROUP_K=gk,
        num_warps=down["num_warps"], num_stages=down["num_stages"],
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
