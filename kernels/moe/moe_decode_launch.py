"""Launcher of the two-launch small-batch (decode) path, moe_serve.kernels.moe.moe_decode: GEMM1 + SiLU into
act [T, N], then GEMM2 + routed weight + top-k sum into out, either split-K or not (the split's
fp32 workspace and arrival counters: split_workspace). With fp8 hidden states in floats and
A_PREQUANT, one quantize-once launch comes first; act is quantized in the up kernel's epilogue
where a tile holds what its scale needs (fp8_scales.gemm2_plan), else by the down kernel on load.
With the config's PDL (sm_90+), the down kernel is a programmatic dependent launch: it waits for
the up kernel (gdc_wait) only before its first act load, so its launch overlaps the up kernel;
with moe_serve.kernels.moe.launch.block_pdl the up kernel is one too, waiting for the kernel before it.
With the config's PREFETCH (sm_90+, a contiguous w2), the up kernel prefetches the hit experts'
down weights into L2 (moe_serve.kernels.moe.moe_decode).
No host sync, buffers sized from shapes only: CUDA-graph capturable."""
from __future__ import annotations

from typing import Any

import torch
import triton

from moe_serve.kernels.moe import configs, fp8_scales
from moe_serve.kernels.moe.config_schema import prequant
from moe_serve.kernels.moe.fp8_scales import FP8, INTERPRET, Fp8Scales, block_stride, scale_strides
from moe_serve.kernels.moe.launch import block_pdl, launch, pdl_supported
from moe_serve.kernels.moe.moe_decode import moe_decode_down_kernel, moe_decode_up_kernel


_SPLIT_WS: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[tuple[torch.Tensor, torch.Tensor]] = []  # a captured graph may still use them


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split_workspace(device: torch.device, n_floats: int, n_counters: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [>= n_floats], int32 [>= n_counters]) for the decode path's split-K reduction.

    Zero on allocation and zero again after every call (each tile's last program clears what
    it read), so a call needs no memset launch. One pair per device and stream, grown in powers
    of two; an outgrown pair is kept alive, since a captured CUDA graph holds its pointers."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    have = _SPLIT_WS.get(key)
    if have is not None and have[0].numel() >= n_floats and have[1].numel() >= n_counters:
        return have
    fl, ct = _pow2_at_least(n_floats), _pow2_at_least(n_counters)
    if have is not None:
        _OUTGROWN.append(have)
        fl, ct = max(fl, have[0].numel()), max(ct, have[1].numel())
    _SPLIT_WS[key] = (torch.zeros(fl, dtype=torch.float32, device=device),
                      torch.zeros(ct, dtype=torch.int32, device=device))
    return _SPLIT_WS[key]


def split_buffers(device: torch.device, T: int, N: int, M: int, K: int, up_tile: int,
                  down_tile: int, split1: int, split2: int, dummy: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [T * 2N], o [M * K], up counters [T * cdiv(N, up_tile)], down counters
    [M * cdiv(K, down_tile)]): views of one split_workspace for the kernels that split (dummy
    for one that does not) of a two-launch decode call."""
    if split1 == 1 and split2 == 1:
        return dummy, dummy, dummy, dummy
    n_h = T * 2 * N if split1 > 1 else 0
    n_c1 = T * triton.cdiv(N, up_tile) if split1 > 1 else 0
    n_o = M * K if split2 > 1 else 0
    n_c2 = M * triton.cdiv(K, down_tile) if split2 > 1 else 0
    wsf, wsc = split_workspace(device, n_h + n_o, n_c1 + n_c2)
    return (wsf[:max(1, n_h)], wsf[n_h:n_h + max(1, n_o)],
            wsc[:max(1, n_c1)], wsc[n_c1:n_c1 + max(1, n_c2)])


PF_CHUNK = 16384                       # bytes per bulk L2 prefetch


def prefetch_mode(cfg: dict[str, Any], w2: torch.Tensor, expert_bytes: int) -> int:
    """The up kernel's PREFETCH for this call: the config's, where the GPU has bulk prefetch (as
    PDL: sm_90+, not the interpreter) and w2 [E, K, N] (expert_bytes per expert) is contiguous in
    16-byte units; else 0."""
    mode = int(cfg.get("PREFETCH", 0))
    aligned = w2.is_contiguous() and expert_bytes % 16 == 0 and w2.data_ptr() % 16 == 0
    return mode if mode and aligned and pdl_supported() else 0


def fused_moe_decode(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tw: torch.Tensor,
                     ids: torch.Tensor, fp8: Fp8Scales | None, on_input: bool, out: torch.Tensor,
                     cfg: dict[str, Any]) -> torch.Tensor:
    """The decode path for x [M, K] (moe_serve.kernels.moe.fused_moe.fused_moe checked the shapes)."""
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
    pdl = bool(cfg.get("PDL")) and pdl_supported()
    chained = pdl and block_pdl()       # the up kernel a dependent launch too
    ws1 = w1s if w1s is not None else dummy
    se1, sn1, sk1 = block_stride(ws1, w1_mode)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    bn2, bk2 = down["BLOCK_N"], down["BLOCK_K"]
    split1, split2 = int(cfg.get("SPLIT_K", 1)), int(down.get("SPLIT_K", 1))
    h, o, cnt1, cnt2 = split_buffers(x.device, T, N, M, K, bn, bn2, split1, split2, dummy)
    w2_bytes = w2[0].numel() * w2.element_size()                    # one expert's down weights
    launch(
        moe_decode_up_kernel, (T, triton.cdiv(N, bn), split1),
        x1, w1, act, ids, tw, a1s if a1s is not None else dummy, ws1,
        a2s if c_quant else dummy, h, cnt1, w2,
        N, K, T, w2_bytes,
        x1.stride(0), x1.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        act.stride(0), act.stride(1), se1, sn1,
        *scale_strides(a1s), sk1, *(scale_strides(a2s) if c_quant == 2 else (0, 0)),
        TOPK=topk, MUL_ROUTED=on_input, A_MODE=a_mode1, W_SCALE=w1_mode, C_QUANT=c_quant,
        EVEN_K=K % bk == 0, SWAP_AB=cfg["SWAP_AB"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
        BLOCK_K=bk, FP8_PREROUND=INTERPRET and (a_mode1 in (2, 3, 6) or c_quant > 0),
        USE_PDL=pdl, PDL_WAIT=chained, SPLIT_K=split1, GROUP_N=gn, GROUP_K=gk,
        PREFETCH=prefetch_mode(cfg, w2, w2_bytes), PF_CHUNK=PF_CHUNK, PF_SLOTS=32 * cfg["num_warps"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"launch_pdl": True} if chained else {}),
    )
    ws2 = w2s if w2s is not None else dummy
    se2, sk2, sn2 = block_stride(ws2, w2_mode)
    launch(
        moe_decode_down_kernel, (M * triton.cdiv(K, bn2), split2),
        act, w2, out, ids, tw, a2s if a2s is not None else dummy, ws2, o, cnt2,
        K, N, M,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), se2, sk2,
        *(scale_strides(a2s) if a_mode2 == 5 else (0, 0)), sn2,
        TOPK=topk, MUL_ROUTED=not on_input, A_MODE=a_mode2, W_SCALE=w2_mode,
        EVEN_N=N % bk2 == 0, SWAP_AB=down["SWAP_AB"],
        BLOCK_M=max(16, triton.next_power_of_2(topk)), BLOCK_N=bn2, BLOCK_K=bk2,
        FP8_PREROUND=INTERPRET and a_mode2 in (2, 3, 6), USE_PDL=pdl, SPLIT_K=split2,
        GROUP_N=gn, GROUP_K=gk,
        num_warps=down["num_warps"], num_stages=down["num_stages"],
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
