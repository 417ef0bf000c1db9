"""Launcher of the CUDA-core decode path, moe_serve.kernels.moe.moe_gemv (a DECODE config with GEMV): the up
GEMV + SiLU into act [T, N] in the output dtype, then the down GEMV + routed weight + top-k sum
into out; split-K in either kernel reduces in the decode path's self-clearing workspace
(moe_serve.kernels.moe.moe_decode_launch.split_workspace). With the config's PDL (sm_90+) the down kernel is
a programmatic dependent launch (with moe_serve.kernels.moe.launch.block_pdl the up kernel too). Two
launches, no host sync, buffers sized from shapes only: CUDA-graph capturable."""
from __future__ import annotations

from typing import Any

import torch
import triton

from moe_serve.kernels.moe import fp8_scales
from moe_serve.kernels.moe.config_schema import down_config
from moe_serve.kernels.moe.fp8_scales import FP8, Fp8Scales, block_stride, scale_strides
from moe_serve.kernels.moe.launch import block_pdl, launch, pdl_supported
from moe_serve.kernels.moe.moe_decode_launch import split_buffers
from moe_serve.kernels.moe.moe_gemv import moe_gemv_down_kernel, moe_gemv_up_kernel


def input_mode(x: torch.Tensor, fp8: Fp8Scales | None) -> tuple[torch.Tensor | None, int]:
    """(scale, A_MODE) of the hidden states as the up GEMV reads them: floats as they are (0,
    never quantized), fp8 dequantized on load (1 static scalar, 4 per token [M], 5 per token
    group [M, groups])."""
    if x.dtype != FP8:
        return None, 0
    M = x.shape[0]
    if fp8.block_shape:
        return fp8.a1_scale.reshape(M, -1), 5
    if fp8.per_token_act:
        return fp8.a1_scale.reshape(M), 4
    return fp8.a1_scale, 1


def sub_k(block_k: int, fp8: Fp8Scales | None, what: str) -> int:
    """The reduction width of one scale group within a BLOCK_K step: block FP8's activation
    group (BLOCK_K must be a multiple of it), else BLOCK_K."""
    if fp8 is None or not fp8.block_shape:
        return block_k
    if block_k % fp8.group_k:
        raise ValueError(f"GEMV {what} BLOCK_K={block_k} must be a multiple of block FP8's "
                         f"group {fp8.group_k}")
    return fp8.group_k


def fused_moe_gemv(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tw: torch.Tensor,
                   ids: torch.Tensor, fp8: Fp8Scales | None, on_input: bool, out: torch.Tensor,
                   cfg: dict[str, Any]) -> torch.Tensor:
    """The GEMV decode path for x [M, K] (moe_serve.kernels.moe.fused_moe.fused_moe checked the shapes)."""
    M, K = x.shape
    E, N = w1.shape[0], w1.shape[1] // 2
    topk = ids.shape[1]
    T = M * topk
    if T > cfg["BLOCK_M"]:
        raise ValueError(f"GEMV config BLOCK_M={cfg['BLOCK_M']} < M*topk={T}")
    ids = ids.contiguous()
    down = down_config(cfg)
    bn1, bk1, split1 = cfg["BLOCK_N"], cfg["BLOCK_K"], int(cfg.get("SPLIT_K", 1))
    bn2, bk2, split2 = down["BLOCK_N"], down["BLOCK_K"], int(down.get("SPLIT_K", 1))
    sk1, sk2 = sub_k(bk1, fp8, "up"), sub_k(bk2, fp8, "down")
    w1s, w1_mode, w2s, w2_mode = fp8_scales.weight_scales(fp8, E, N, K)
    a1s, a_mode = input_mode(x, fp8)
    act = torch.empty((T, N), dtype=out.dtype, device=x.device)                 # [T, N]
    dummy = tw
    pdl = bool(cfg.get("PDL")) and pdl_supported()
    chained = pdl and block_pdl()
    h, o, cnt1, cnt2 = split_buffers(x.device, T, N, M, K, bn1, bn2, split1, split2, dummy)
    ws1 = w1s if w1s is not None else dummy
    se1, sn1, sg1 = block_stride(ws1, w1_mode)
    launch(
        moe_gemv_up_kernel, (T, triton.cdiv(N, bn1), split1),
        x, w1, act, ids, tw, a1s if a1s is not None else dummy, ws1, h, cnt1,
        N, K,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        act.stride(0), act.stride(1), *scale_strides(a1s), se1, sn1, sg1,
        TOPK=topk, MUL_ROUTED=on_input, A_MODE=a_mode, W_SCALE=w1_mode, EVEN_K=K % bk1 == 0,
        BLOCK_N=bn1, BLOCK_K=bk1, SUB_K=sk1, USE_PDL=pdl, PDL_WAIT=chained, SPLIT_K=split1,
        GROUP_N=fp8.group_n if fp8 is not None else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"launch_pdl": True} if chained else {}),
    )
    ws2 = w2s if w2s is not None else dummy
    se2, sk2_row, sg2 = block_stride(ws2, w2_mode)
    launch(
        moe_gemv_down_kernel, (M * triton.cdiv(K, bn2), split2),
        act, w2, out, ids, tw, ws2, o, cnt2,
        K, N, M,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), se2, sk2_row, sg2,
        TOPK=topk, MUL_ROUTED=not on_input, W_SCALE=w2_mode, EVEN_N=N % bk2 == 0,
        TOPK_P2=triton.next_power_of_2(topk), BLOCK_N=bn2, BLOCK_K=bk2, SUB_K=sk2,
        USE_PDL=pdl, SPLIT_K=split2, GROUP_N=fp8.group_n if fp8 is not None else 0,
        num_warps=down["num_warps"], num_stages=down["num_stages"],
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
