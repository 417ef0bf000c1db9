"""The search's candidate configs: each phase's generator (one dimension, or a joint grid, around
the current best of a family: aligned, decode, gemv) and the static pruning every candidate passes
before it is compiled or timed (tl.dot dims >= 16, swapped tiles 64-row, shared memory <= 227 KB,
GEMV tiles no larger than the padded dims; moe_serve.kernels.tuning.tune runs them)."""
from __future__ import annotations

from moe_serve.kernels.moe import configs, quant_format, smem
from moe_serve.kernels.moe.config_schema import PREFETCH_MODES, Config, prequant, validate, with_block_k


def _k_tiles(K: int, bk: int) -> int:
    return -(-K // bk)


def _pow2_ceil(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _ok_tile(c: dict, n_rows: int, k_in: int) -> bool:
    """tl.dot dims >= 16, swapped tiles need BLOCK_N % 64 == 0 (wgmma M slot), BLOCK_K and
    BLOCK_N not above the padded dims, SPLIT_K leaves >= 1 K tile per split."""
    if min(c["BLOCK_N"], c["BLOCK_K"], c["BLOCK_M"]) < 16:
        return False
    if c["SWAP_AB"] and (c["BLOCK_N"] % 64 or c["BLOCK_M"] >= 64):
        return False
    if c["BLOCK_K"] > _pow2_ceil(k_in) or c["BLOCK_N"] > _pow2_ceil(n_rows):
        return False
    return c.get("SPLIT_K", 1) <= _k_tiles(k_in, c["BLOCK_K"])


def normalize(cfg: dict, dtype: str) -> Config:
    """A candidate as the format runs it (validated; block FP8: BLOCK_K = the group)."""
    cfg = validate(cfg)
    bs = quant_format.block_shape(dtype)
    return with_block_k(cfg, bs[1]) if bs else cfg


def _ok_gemv(cfg: Config, N: int, K: int, topk: int, group: int) -> bool:
    """GEMV tiles no larger than the padded dims they step over (a K step may exceed its dim
    up to block FP8's group, of which it must be a multiple), each split with >= 1 step."""
    d = configs.down_config(cfg)
    return (cfg["BLOCK_N"] <= _pow2_ceil(N) and d["BLOCK_N"] <= _pow2_ceil(K)
            and cfg["BLOCK_K"] <= max(_pow2_ceil(K), group)
            and d["BLOCK_K"] <= max(_pow2_ceil(N), group)
            and cfg["SPLIT_K"] <= _k_tiles(K, cfg["BLOCK_K"])
            and d["SPLIT_K"] <= topk * _k_tiles(N, d["BLOCK_K"]))


def legal(cfg: dict, N: int, K: int, topk: int, dtype: str) -> bool:
    try:
        cfg = normalize(cfg, dtype)
    except ValueError:
        return False
    if cfg.get("GEMV"):
        bs = quant_format.block_shape(dtype)
        return _ok_gemv(cfg, N, K, topk, bs[1] if bs else 0)
    d = configs.down_config(cfg)
    rows1 = N if cfg["FUSE_GU"] else 2 * N
    if cfg.get("DECODE"):                        # the down kernel's own row tile; its split
        if d["SPLIT_K"] > topk * _k_tiles(N, d["BLOCK_K"]):   # shares the slot x chunk loop
            return False
        d = {**d, "BLOCK_M": 16, "SPLIT_K": 1}
    est = smem.gemm_estimates(cfg, quant_format.weight_dtype(dtype), topk=topk)
    return _ok_tile(cfg, rows1, K) and _ok_tile(d, K, N) and max(est) <= smem.SMEM_LIMIT


def legal_unique(cs: list[dict], have: list[Config], N: int, K: int, topk: int,
                 dtype: str) -> list[Config]:
    """The legal candidates of cs, normalised for the format, without repeats or any in have."""
    out: list[Config] = []
    for c in cs:
        if legal(c, N, K, topk, dtype):
            v = normalize(c, dtype)
            if v not in out and v not in have:
                out.append(v)
    return out


def vary(base: dict, key: str, values, down: bool = False) -> list[dict]:
    if down:
        return [{**base, "DOWN": {**base["DOWN"], key: v}} for v in values
                if v != base["DOWN"].get(key)]
    return [{**base, key: v} for v in values if v != base.get(key)]


# ---- aligned family ------------------------------------------------------------------------
def aligned_a(cur: dict, K: int) -> list[dict]:
    """GEMM1 (FUSE_GU x SPLIT_K) grid around cur (small M only)."""
    g = {k: v for k, v in cur.items() if k != "DOWN"}      # GEMM1's keys, A_PREQUANT kept
    if g["BLOCK_M"] >= 64:
        return []
    kt = _k_tiles(K, g["BLOCK_K"])
    s0 = g["SPLIT_K"]
    splits = sorted({s for s in (1, s0 // 2, s0, s0 * 2, s0 * 4) if 1 <= s <= min(kt, 16)})
    out = []
    for fgu in (True, False):
        for sk in splits:
            c = {**g, "FUSE_GU": fgu, "SPLIT_K": sk, "DOWN": cur["DOWN"]}
            if fgu and g["SWAP_AB"]:
                c["BLOCK_N"] = 64
            out.append(c)
    return out


def aligned_b(cur: dict, dtype: str) -> list[dict]:
    """GEMM1 tiles, one dimension at a time (fp8: and x quantized once or not, A_PREQUANT)."""
    fp8 = quant_format.is_fp8(dtype)
    out = vary(cur, "BLOCK_K", (128, 256) if fp8 else (64, 128))
    if fp8:
        out += [{**cur, "A_PREQUANT": not prequant(cur)}]
    out += vary(cur, "num_stages", (3, 4, 5) if cur["BLOCK_M"] <= 32 else (3, 4))
    out += vary(cur, "BLOCK_N", (64, 128) if cur["SWAP_AB"] else (64, 128, 256))
    if cur["BLOCK_M"] < 64:
        out += [{**cur, "SWAP_AB": not cur["SWAP_AB"]}]
        out += vary(cur, "BLOCK_M", (16, 32))
    else:
        out += vary(cur, "num_warps", (4, 8))
        out += vary(cur, "GROUP_M", (1, 8))
    return out


def aligned_c(cur: dict, N: int, dtype: str) -> list[dict]:
    """GEMM2 (DOWN): SPLIT_K, then BK / stages / BN / swap."""
    d = {k: v for k, v in configs.down_config(cur).items() if k != "BLOCK_M"}
    small = cur["BLOCK_M"] < 64
    base = {**cur, "DOWN": d}
    out = []
    if small:
        out += vary(base, "SPLIT_K", [s for s in (1, 2, 4, 8) if s <= _k_tiles(N, d["BLOCK_K"])],
                     down=True)
    out += vary(base, "BLOCK_K", (128, 256) if quant_format.is_fp8(dtype) else (64, 128), down=True)
    out += vary(base, "num_stages", (3, 4) if not small else (2, 3, 4), down=True)
    out += vary(base, "BLOCK_N", (64, 128) if d["SWAP_AB"] else (64, 128, 256), down=True)
    if small:
        out += [{**base, "DOWN": {**d, "SWAP_AB": not d["SWAP_AB"]}}]
    return out


# ---- decode family ---------------------------------------------------------------------------
def decode_up_tiles(cur: dict) -> list[dict]:
    return [{**cur, "SWAP_AB": sw, "BLOCK_N": bn}
            for sw, bn in ((False, 16), (False, 32), (False, 64), (True, 64), (True, 128))
            if (sw, bn) != (cur["SWAP_AB"], cur["BLOCK_N"])]


def decode_down_tiles(cur: dict) -> list[dict]:
    return [{**cur, "DOWN": {**cur["DOWN"], "SWAP_AB": sw, "BLOCK_N": bn, "BLOCK_K": bk}}
            for sw, bn in ((False, 16), (False, 32), (False, 64), (True, 64))
            for bk in (64, 128, 256)]


def decode_up_occupancy(cur: dict) -> list[dict]:
    """The up kernel's split-K, stages and BLOCK_K jointly: more programs (split) that each hold
    less shared memory (fewer stages, a shorter K tile), so a one-token call fills every SM with
    more than one program. Walked one at a time each loses (a split alone overflows one wave,
    fewer stages alone leave the same SMs idle: ncu, Qwen3-30B-A3B M = 1, 96 CTAs on 132 SMs)."""
    return [{**cur, "SPLIT_K": sk, "num_stages": st, "BLOCK_K": bk}
            for sk in (1, 2, 4) for st in (2, 3, 4) for bk in (64, 128)
            if (sk, st, bk) != (cur.get("SPLIT_K", 1), cur["num_stages"], cur["BLOCK_K"])]


def decode_down_occupancy(cur: dict) -> list[dict]:
    """The down kernel's tile, K chunk, split-K and stages jointly: fewer, longer programs or more,
    lighter ones (ncu: 128 CTAs of 6 weight tiles each reached 46 % of DRAM bandwidth)."""
    d = cur["DOWN"]
    widths = (64, 128) if d["SWAP_AB"] else (32, 64)
    out = [{**cur, "DOWN": {**d, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_stages": st}}
           for bn in widths for bk in (128, 256) for sk in (1, 2, 4, 8) for st in (2, 3, 4)]
    return [c for c in out if c["DOWN"] != d]


def decode_prefetch(cur: dict) -> list[dict]:
    """The up kernel's L2 prefetch of the down weights: off, as it starts, after its K loop."""
    return [{**cur, "PREFETCH": v} for v in PREFETCH_MODES if v != cur.get("PREFETCH", 0)]


# ---- gemv family (the decode path on CUDA cores) ------------------------------------------------
def gemv_up_tiles(cur: dict) -> list[dict]:
    return [{**cur, "BLOCK_N": bn, "BLOCK_K": bk} for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)]


def gemv_up_occupancy(cur: dict) -> list[dict]:
    return [{**cur, "num_warps": w, "SPLIT_K": sk} for w in (2, 4, 8) for sk in (1, 2, 4, 8)]


def gemv_down_tiles(cur: dict) -> list[dict]:
    return [{**cur, "DOWN": {**cur["DOWN"], "BLOCK_N": bn, "BLOCK_K": bk}}
            for bn in (4, 8, 16, 32) for bk in (128, 256, 512)]


def gemv_down_occupancy(cur: dict) -> list[dict]:
    return [{**cur, "DOWN": {**cur["DOWN"], "num_warps": w, "SPLIT_K": sk}}
            for w in (2, 4, 8) for sk in (1, 2, 4, 8, 16)]


def gemv_stages(cur: dict) -> list[dict]:
    """Software-pipelined loads (num_stages > 1) in either kernel, or none."""
    return (vary(cur, "num_stages", (1, 2, 3))
            + vary(cur, "num_stages", (1, 2, 3), down=True))
