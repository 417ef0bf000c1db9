"""Default configs for shapes with no tuned table: the decode path for few tokens per
expert, else the aligned path (vLLM's own config for the shape where vLLM ships one).

The decode rules come from a coordinate search over 12 MoE shapes x {bf16, fp8} x M on an
H200 (bench/results/2026-12-01/decode_sweep): the decode path beat the aligned path in
nearly every cell with M * topk <= 32 and M * topk <= E (few tokens per expert), and lost
where many tokens share an expert (Mixtral M >= 8) or the A tile has >= 64 rows; the
validation run against vLLM (kernels_validation/untuned.json) set the M=1 exception.
"""
from __future__ import annotations

from typing import Any

from moe_serve.kernels.moe import quant_format
from moe_serve.kernels.moe.config_schema import MAX_SPLIT_K, Config, validate

NUM_SMS_DEFAULT = 132  # H100/H200 SXM
DECODE_MAX_SLOTS = 32


def expected_experts(M: int, E: int, topk: int) -> float:
    """Expected number of distinct experts hit by M tokens under uniform top-k routing."""
    return E * (1.0 - (1.0 - min(topk, E) / E) ** M)


def decode_block_m(M: int, topk: int) -> int:
    """Rows of the decode path's A tile: all M * topk slots, padded to a power of two >= 16."""
    return max(16, 1 << (M * topk - 1).bit_length())


def use_decode_path(M: int, E: int, topk: int, N: int, K: int) -> bool:
    """Default path choice for bucket M: decode while slots are few and rarely share experts,
    unless its down kernel would run fewer than 64 programs (M x K / 64) that each stream a
    wide expert row block (N >= 512): there, on the H200, M=1 lost to vLLM by 0.79-0.94x in
    every measured shape (K 2048..2880, N 768..1440) and won wherever K >= 4096 or N < 512."""
    if M * topk > min(DECODE_MAX_SLOTS, E):
        return False
    return not (M * -(-K // 64) < 64 and N >= 512)


def _pow2_at_most(limit: int, cap: int) -> int:
    """min(cap, the padded reduction length) for a BLOCK_K: no tile larger than the dim."""
    return min(cap, max(16, 1 << (limit - 1).bit_length()))


def decode_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                  split: bool = False) -> Config:
    """Decode-path config for bucket M (moe_serve.kernels.moe.moe_decode), all M * topk slots in one tile.

    Up kernel: 32-row weight tiles without swap (mma.sync, BLOCK_K 256) while they give
    fewer than ~160 programs (hit experts x N / 32), else swapped 64-row tiles (wgmma;
    BLOCK_K 128 bf16 / 256 fp8). Down kernel: swapped 64-row tiles when M x K / 64 >= 16
    programs (fewer, longer programs won at M = 1 down to K = 1024), else 32 or 16 rows;
    BLOCK_K 256 (<= padded N); 4 stages (5 for fp8); PDL. With `split`, the down kernel (and,
    for fp8, the up kernel) splits its reduction where its tiles leave most SMs idle
    (decode_split): on the H200 splitting won where a kernel had <= ~64 programs and lost where it already had ~128, and
    splitting the bf16 up kernel lost in 6 of the 8 shapes where it was split. Not the default until the
    routing table's untuned-shape cells are measured with it. Block FP8: BLOCK_K = the
    activation group (128) in both kernels, so one more stage each keeps about as many weight
    bytes in flight (untimed: a starting point for the tuner)."""
    fp8 = dtype.startswith("fp8")
    block = quant_format.block_shape(dtype)
    p32 = expected_experts(M, E, topk) * -(-N // 32)
    if p32 < 160:
        swap1, bn1, bk1 = False, 32, 256
    else:
        swap1, bn1, bk1 = True, 64, 256 if fp8 else 128
    if M * -(-K // 64) >= 16:
        swap2, bn2 = True, 64
    elif M * -(-K // 32) >= 16:
        swap2, bn2 = False, 32
    else:
        swap2, bn2 = False, 16
    bk1, bk2 = _pow2_at_most(K, bk1), _pow2_at_most(N, 256)
    stages1, stages2 = 4, 5 if fp8 else 4
    if block:
        bk1 = bk2 = block[1]
        stages1, stages2 = 5, 6
    split1 = split2 = 1
    if split:
        if fp8:
            split1 = decode_split(round(expected_experts(M, E, topk)) * -(-N // bn1),
                                  -(-K // bk1), 4)
        split2 = decode_split(M * -(-K // bn2), topk * -(-N // bk2), 2)
    cfg = {"DECODE": True, "PDL": True, "BLOCK_M": decode_block_m(M, topk), "BLOCK_N": bn1,
           "BLOCK_K": bk1, "GROUP_M": 1, "num_warps": 4, "num_stages": stages1,
           "SWAP_AB": swap1, "SPLIT_K": split1,
           "DOWN": {"BLOCK_N": bn2, "BLOCK_K": bk2, "GROUP_M": 1, "num_warps": 4,
                    "num_stages": stages2, "SWAP_AB": swap2, "SPLIT_K": split2}}
    return validate(cfg)


def gemv_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """Starting config of the CUDA-core decode path (moe_serve.kernels.moe.moe_gemv) for bucket M: the
    tuner's seed, never an untuned default. Up: 16 gate + 16 up rows x 512 columns per step
    (1 KB of each row in fp8: 1024), down: 8 output rows x 256 columns (fp8: 512), 4 warps;
    each kernel split until it has ~4 programs per SM (light programs, several resident per
    SM), keeping >= 2 steps per split. Block FP8 keeps these widths (multiples of its group)."""
    fp8 = dtype.startswith("fp8")
    bk1 = _pow2_at_most(K, 1024 if fp8 else 512)
    bk2 = _pow2_at_most(N, 512 if fp8 else 256)
    block = quant_format.block_shape(dtype)
    if block:
        bk1, bk2 = max(bk1, block[1]), max(bk2, block[1])
    slots = M * topk
    target = 4 * num_sms
    split1 = split_k_for(slots * -(-N // 16), -(-K // bk1), target, min_tiles=2)
    split2 = split_k_for(M * -(-K // 8), topk * -(-N // bk2), target, min_tiles=2)
    common = {"GROUP_M": 1, "num_warps": 4, "num_stages": 1, "SWAP_AB": False}
    return validate({"DECODE": True, "GEMV": True, "PDL": True, "BLOCK_M": decode_block_m(M, topk),
                     "BLOCK_N": 16, "BLOCK_K": bk1, **common, "SPLIT_K": split1,
                     "DOWN": {"BLOCK_N": 8, "BLOCK_K": bk2, **common, "SPLIT_K": split2}})


def decode_split(programs: int, iterations: int, min_iterations: int,
                 num_sms: int = NUM_SMS_DEFAULT) -> int:
    """SPLIT_K of a decode kernel: 1 when its programs fill at least half the SMs, else the
    smallest power of two (<= MAX_SPLIT_K) giving ~two programs per SM, while each split keeps
    >= min_iterations of the reduction loop's `iterations` (weight tiles streamed back to back)."""
    s = 1
    if 2 * max(1, programs) > num_sms:
        return s
    while (max(1, programs) * s < 1.9 * num_sms and 2 * s <= MAX_SPLIT_K
           and iterations >= 2 * s * min_iterations):
        s *= 2
    return s


def _tile_n(n_out: int, active_blocks: int, allow_small: bool, num_sms: int) -> int:
    """Largest BLOCK_N in {128, 64, (32, 16)} that still gives ~num_sms programs."""
    choices = (128, 64, 32, 16) if allow_small else (128, 64)
    for bn in choices:
        if active_blocks * -(-n_out // bn) >= num_sms:
            return bn
    return choices[-1]


def split_k_for(programs: int, k_tiles: int, target: int, min_tiles: int = 2) -> int:
    """Smallest power-of-two SPLIT_K giving >= target programs, keeping >= min_tiles K tiles
    per split (each program must still stream a pipeline's worth of weight)."""
    s = 1
    while programs * s < target and s * 2 <= MAX_SPLIT_K and k_tiles >= 2 * s * min_tiles:
        s *= 2
    return s


def aligned_config(M: int, E: int, N: int, K: int, topk: int, dtype: str,
                   num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """Aligned-path config for bucket M when neither a table nor vLLM's config is at hand.
    Tiles give >= ~1 wave of programs, swap AB while BLOCK_M < 64; when GEMM1's fused grid
    is under ~2 programs per SM, un-fuse gate/up and split K; GEMM2 likewise splits K."""
    fp8 = dtype.startswith("fp8")
    block = quant_format.block_shape(dtype)
    slots = M * topk
    tokens_per_expert = slots / E
    block_m = 16 if tokens_per_expert <= 16 else 32 if tokens_per_expert <= 32 else \
        64 if tokens_per_expert <= 96 else 128
    active_blocks = max(1, min(slots, E)) if block_m < 64 else max(1, slots // block_m)
    swap = block_m < 64
    bk = 128 if fp8 else 64
    if block_m <= 32:
        bk = 256 if fp8 else 128
    if block:                          # one K step = one activation group
        bk = block[1]
    stages = 4 if block_m <= 32 else 3
    gate = {"BLOCK_M": block_m, "BLOCK_K": bk if block else _pow2_at_most(K, bk),
            "GROUP_M": 1 if tokens_per_expert < 128 else 8,
            "num_warps": 4 if block_m <= 64 else 8, "num_stages": stages}
    bn1 = _tile_n(N, active_blocks, not swap, num_sms)
    bn2 = _tile_n(K, active_blocks, not swap, num_sms)
    if block_m >= 128:
        bn1 = bn2 = 128
    cfg = {**gate, "BLOCK_N": bn1, "SWAP_AB": swap, "SPLIT_K": 1, "FUSE_GU": True}
    down_bk = bk if block else _pow2_at_most(N, bk)
    down = {"BLOCK_N": bn2, "BLOCK_K": down_bk, "GROUP_M": gate["GROUP_M"],
            "num_warps": gate["num_warps"], "num_stages": stages, "SWAP_AB": swap, "SPLIT_K": 1}
    target = 2 * num_sms
    if block_m < 64:
        p1 = active_blocks * -(-N // bn1)
        if p1 < target:
            bn1 = 64 if swap else bn1
            cfg["BLOCK_N"] = bn1
            cfg["FUSE_GU"] = False
            p1 = active_blocks * -(-2 * N // bn1)
            cfg["SPLIT_K"] = split_k_for(p1, -(-K // cfg["BLOCK_K"]), target)
        p2 = active_blocks * -(-K // bn2)
        down["SPLIT_K"] = split_k_for(p2, -(-N // down_bk), target)
        if down["SPLIT_K"] > 1 or not cfg["FUSE_GU"]:  # fp32 h tiles double A's smem
            down["num_stages"] = min(stages, 3)
    # stages beyond a program's K tiles only cost shared memory (hence occupancy)
    cfg["num_stages"] = max(2, min(cfg["num_stages"],
                                   -(-K // (cfg["BLOCK_K"] * cfg["SPLIT_K"]))))
    down["num_stages"] = max(2, min(down["num_stages"], -(-N // (down_bk * down["SPLIT_K"]))))
    cfg["DOWN"] = down
    return validate(cfg)


def from_vllm_config(vcfg: dict[str, Any], dtype: str = "bf16") -> Config:
    """Our aligned-path config with the tiles of a vLLM fused_moe config (BLOCK_SIZE_M/N/K,
    GROUP_SIZE_M, num_warps, num_stages). vLLM's GEMM1 program covers BLOCK_SIZE_N of the 2N
    gate|up rows; ours covers BLOCK_N gate + BLOCK_N up rows, so BLOCK_N = BLOCK_SIZE_N / 2
    keeps the bytes per program and the grid. GEMM2 takes the tiles as they are.

    Per-tensor and per-token FP8 with BLOCK_SIZE_M = 32 (vLLM's default tile for M 33..96,
    which vLLM itself swaps on Hopper): both GEMMs swapped with 64-row weight tiles (gate and
    up fused, so GEMM1 has half vLLM's programs). On the H200 the unswapped mapping ran 0.76-0.82x
    of vLLM's kernel and this one 1.03-1.09x, at M = 48 and 64 on four untuned shapes in both
    formats."""
    bm = max(16, int(vcfg["BLOCK_SIZE_M"]))
    bn = int(vcfg["BLOCK_SIZE_N"])
    common = {"GROUP_M": int(vcfg.get("GROUP_SIZE_M", 1)), "num_warps": int(vcfg["num_warps"]),
              "num_stages": int(vcfg["num_stages"]), "SWAP_AB": False}
    bn1, bn2 = max(16, bn // 2), bn
    swap = (quant_format.is_fp8(dtype) and not quant_format.block_shape(dtype)
            and 1 << (bm - 1).bit_length() == 32)
    if swap:
        bn1, bn2 = max(64, bn1), max(64, bn2)
    common1 = {**common, "SWAP_AB": swap}
    return validate({"BLOCK_M": 1 << (bm - 1).bit_length(), "BLOCK_N": bn1,
                     "BLOCK_K": int(vcfg["BLOCK_SIZE_K"]), **common1, "SPLIT_K": 1,
                     "FUSE_GU": True,
                     "DOWN": {"BLOCK_N": bn2, "BLOCK_K": int(vcfg["BLOCK_SIZE_K"]), **common1}})
