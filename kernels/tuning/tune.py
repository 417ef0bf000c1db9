"""Search fused-MoE configs for one shape on the GPU, timed under CUDA-graph replay.

Per M bucket two families compete, each starting from its default and walked one dimension
at a time (phases), every phase's new candidates compiled for sm_90 on the host CPU first
(kernels.tuning.precompile), then timed:
  decode (buckets with M * topk <= 64, kernels.moe.moe_decode): up tile, up BLOCK_K, up stages,
      down tile, down stages, up split-K, down split-K, PDL, the down weights' L2 prefetch
      (fp8: and A_PREQUANT); after the aligned phases, two joint grids (up: split-K x stages x
      BLOCK_K; down: tile x BLOCK_K x split-K x stages), where single-dimension walks cannot
      trade programs for occupancy;
  gemv (buckets with M * topk <= 32, kernels.moe.moe_gemv: the decode path on CUDA cores): up
      tile (rows x K step), up warps x split-K, down tile, down warps x split-K, stages, PDL;
  aligned (every bucket): A GEMM1 split/fuse, B GEMM1 tiles (fp8: and A_PREQUANT), C GEMM2;
  then D: each bucket tries its neighbours' winners (one-dimension walks stop at local
  optima). The fastest family wins the bucket.
`dtype` is the layer's kernels.moe.quant_format key: each format is tuned on its own (block FP8
candidates keep BLOCK_K = the activation group, so its BLOCK_K walks collapse).
Candidates are pruned statically first (tl.dot dims >= 16, swapped tiles 64-row, shared
memory <= 227 KB; GEMV tiles no larger than the padded dims). A time budget stops the search and keeps the best so far; `state` (a
dict the caller may persist) lets an interrupted search resume after its last phase.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.moe import configs, heuristics, quant_format, smem
from kernels.moe.config_schema import PREFETCH_MODES, Config, prequant, validate, with_block_k
from kernels.tuning import precompile
from kernels.tuning.timing import make_problem, time_ours

DECODE_TUNE_MAX_SLOTS = 64
GEMV_TUNE_MAX_SLOTS = 32
FAMILIES = ("decode", "gemv", "aligned")


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


def _vary(base: dict, key: str, values, down: bool = False) -> list[dict]:
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
    out = _vary(cur, "BLOCK_K", (128, 256) if fp8 else (64, 128))
    if fp8:
        out += [{**cur, "A_PREQUANT": not prequant(cur)}]
    out += _vary(cur, "num_stages", (3, 4, 5) if cur["BLOCK_M"] <= 32 else (3, 4))
    out += _vary(cur, "BLOCK_N", (64, 128) if cur["SWAP_AB"] else (64, 128, 256))
    if cur["BLOCK_M"] < 64:
        out += [{**cur, "SWAP_AB": not cur["SWAP_AB"]}]
        out += _vary(cur, "BLOCK_M", (16, 32))
    else:
        out += _vary(cur, "num_warps", (4, 8))
        out += _vary(cur, "GROUP_M", (1, 8))
    return out


def aligned_c(cur: dict, N: int, dtype: str) -> list[dict]:
    """GEMM2 (DOWN): SPLIT_K, then BK / stages / BN / swap."""
    d = {k: v for k, v in configs.down_config(cur).items() if k != "BLOCK_M"}
    small = cur["BLOCK_M"] < 64
    base = {**cur, "DOWN": d}
    out = []
    if small:
        out += _vary(base, "SPLIT_K", [s for s in (1, 2, 4, 8) if s <= _k_tiles(N, d["BLOCK_K"])],
                     down=True)
    out += _vary(base, "BLOCK_K", (128, 256) if quant_format.is_fp8(dtype) else (64, 128), down=True)
    out += _vary(base, "num_stages", (3, 4) if not small else (2, 3, 4), down=True)
    out += _vary(base, "BLOCK_N", (64, 128) if d["SWAP_AB"] else (64, 128, 256), down=True)
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
    return (_vary(cur, "num_stages", (1, 2, 3))
            + _vary(cur, "num_stages", (1, 2, 3), down=True))


PHASES: list[tuple[str, str, Callable[..., list[dict]]]] = [  # (name, family, candidates)
    ("decode up tile", "decode", lambda c, s: decode_up_tiles(c)),
    ("decode up BLOCK_K", "decode", lambda c, s: _vary(c, "BLOCK_K", (64, 128, 256))),
    ("decode up stages", "decode", lambda c, s: _vary(c, "num_stages", (3, 4, 5, 6))),
    ("decode down tile", "decode", lambda c, s: decode_down_tiles(c)),
    ("decode down stages", "decode", lambda c, s: _vary(c, "num_stages", (3, 4, 5, 6), down=True)),
    ("decode up split", "decode", lambda c, s: _vary(c, "SPLIT_K", (1, 2, 4, 8))),
    ("decode down split", "decode", lambda c, s: _vary(c, "SPLIT_K", (1, 2, 4, 8, 16), down=True)),
    ("decode PDL", "decode", lambda c, s: [{**c, "PDL": not c.get("PDL", False)}]),
    ("decode prefetch", "decode", lambda c, s: decode_prefetch(c)),
    ("decode A quant", "decode", lambda c, s: [{**c, "A_PREQUANT": not prequant(c)}]
     if quant_format.is_fp8(s["dtype"]) else []),
    ("gemv up tile", "gemv", lambda c, s: gemv_up_tiles(c)),
    ("gemv up occupancy", "gemv", lambda c, s: gemv_up_occupancy(c)),
    ("gemv down tile", "gemv", lambda c, s: gemv_down_tiles(c)),
    ("gemv down occupancy", "gemv", lambda c, s: gemv_down_occupancy(c)),
    ("gemv stages", "gemv", lambda c, s: gemv_stages(c)),
    ("gemv PDL", "gemv", lambda c, s: [{**c, "PDL": not c.get("PDL", False)}]),
    ("aligned A gate split/fuse", "aligned", lambda c, s: aligned_a(c, s["K"])),
    ("aligned B gate tiles", "aligned", lambda c, s: aligned_b(c, s["dtype"])),
    ("aligned C down", "aligned", lambda c, s: aligned_c(c, s["N"], s["dtype"])),
    ("decode up occupancy", "decode", lambda c, s: decode_up_occupancy(c)),
    ("decode down occupancy", "decode", lambda c, s: decode_down_occupancy(c)),
]


def starts(b: int, E: int, N: int, K: int, topk: int, dtype: str, device: str) -> list[Config]:
    """The bucket's starting configs: the default, the decode family's with and without
    split-K, the gemv family's, and the aligned family's."""
    out = [configs.default_config(b, E, N, K, topk, dtype, device)]
    if b * topk <= DECODE_TUNE_MAX_SLOTS:
        out.append(heuristics.decode_config(b, E, N, K, topk, dtype))
        out.append(heuristics.decode_config(b, E, N, K, topk, dtype, split=True))
    if b * topk <= GEMV_TUNE_MAX_SLOTS:
        out.append(heuristics.gemv_config(b, E, N, K, topk, dtype))
    out.append(configs.aligned_default(b, E, N, K, topk, dtype, device))
    return out


def family(cfg: Config) -> str:
    """The family a config belongs to (one of FAMILIES)."""
    return "gemv" if cfg.get("GEMV") else "decode" if cfg.get("DECODE") else "aligned"


def time_candidate(shape: dict[str, Any], M: int, cfg: Config, prob: dict[str, Any],
                   log: Callable[[str], None]) -> float:
    """us per call of cfg on prob (a make_problem of shape {E, N, K, topk, dtype} at M); inf
    when its precompiled variant cannot run or it fails on the device."""
    E, N, K, topk, dtype = (shape[k] for k in ("E", "N", "K", "topk", "dtype"))
    if not precompile.compiles_ok(E, N, K, topk, dtype, M, cfg):
        return float("inf")
    try:
        return time_ours(prob, cfg)
    except Exception as e:  # noqa: BLE001 - OutOfResources, compile errors, ...
        log(f"    skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return float("inf")


def tune_shape(E: int, N: int, K: int, topk: int, dtype: str, buckets: tuple[int, ...],
               budget_s: float, device: str = "cuda", log: Callable[[str], None] = print,
               parallel: bool = True, state: dict[str, Any] | None = None,
               on_phase: Callable[[dict[str, Any]], None] | None = None) -> dict[int, Config]:
    """{bucket: best config} for one shape and dtype (see the module doc). `state` carries
    {"done": [phase names], "best": {family: {bucket: [us, cfg]}}} across a resume;
    on_phase(state) is called after each phase (checkpointing, progress)."""
    t0 = time.perf_counter()
    st = state if state is not None else {}
    st.setdefault("done", [])
    best: dict[str, dict[int, list]] = {f: {int(b): v for b, v in d.items()}
                                         for f, d in st.get("best", {}).items()}
    for fam in FAMILIES:
        best.setdefault(fam, {})
    st["best"] = best
    shape = {"E": E, "N": N, "K": K, "topk": topk, "dtype": dtype}
    dev = "cuda" if device.startswith("cuda") else "cpu"
    cfg_device = configs.device_name() if dev == "cuda" else "cpu"
    probs: dict[int, dict] = {}
    weights = None

    def prob(b: int) -> dict:
        nonlocal weights
        if b not in probs:
            probs[b] = make_problem(E, N, K, topk, b, dtype, n_sets=8, device=dev, seed=b,
                                    weights=weights)
            weights = probs[b]["weights"]
        return probs[b]

    def over() -> bool:
        return time.perf_counter() - t0 > budget_s

    def timed(b: int, cfg: Config) -> float:
        return time_candidate(shape, b, cfg, prob(b), log)

    def offer(b: int, cfg: Config, t: float) -> None:
        fam = family(cfg)
        if t < best[fam].get(b, [float("inf")])[0]:
            best[fam][b] = [t, cfg]

    def run(name: str, cands: dict[int, list[Config]]) -> None:
        if parallel and dev == "cuda":
            precompile.precompile([(E, N, K, topk, dtype, b, c) for b in buckets for c in cands[b]],
                                  log=log)
        for b in buckets:
            for c in cands[b]:
                if over():
                    log(f"  {name}: budget spent at bucket {b}")
                    return
                offer(b, c, timed(b, c))
        st["done"].append(name)
        if on_phase:
            on_phase(st)

    def unique(cs: list[dict], have: list[Config]) -> list[Config]:
        return legal_unique(cs, have, N, K, topk, dtype)

    if "starts" not in st["done"]:
        run("starts", {b: unique(starts(b, E, N, K, topk, dtype, cfg_device), [])
                       for b in buckets})
    for name, fam, make in PHASES:
        if name in st["done"] or over():
            continue
        cands = {}
        for b in buckets:
            cur = best[fam].get(b)
            cands[b] = unique(make(cur[1], shape), [cur[1]]) if cur else []
        run(name, cands)
    if "D neighbours" not in st["done"] and not over():
        final = winners(best, buckets)
        cands = {}
        for b in buckets:
            i = buckets.index(b)
            cands[b] = unique([final[n] for n in buckets[max(0, i - 1):i + 2]
                               if n != b and n in final
                               and (not final[n].get("DECODE")
                                    or final[n]["BLOCK_M"] >= b * topk)],
                              [final[b]] if b in final else [])
        run("D neighbours", cands)
    probs.clear()
    out = winners(best, buckets)
    missing = [b for b in buckets if b not in out]
    for b in missing:   # budget spent before the bucket was timed: the default, fitted
        out[b] = configs.default_config(b, E, N, K, topk, dtype, cfg_device)
    return {b: configs.fit(c, dtype, topk=topk) for b, c in out.items()}


def winners(best: dict[str, dict[int, list]], buckets: tuple[int, ...]) -> dict[int, Config]:
    """The fastest family's config per bucket (buckets never timed are absent)."""
    out = {}
    for b in buckets:
        cands = [best[f][b] for f in FAMILIES if b in best.get(f, {})]
        if cands:
            out[b] = min(cands, key=lambda tc: tc[0])[1]
    return out


def best_times(state: dict[str, Any], buckets: tuple[int, ...]) -> dict[int, float]:
    """Our best us per bucket from a search state (for the summary)."""
    out = {}
    for b in buckets:
        ts = [state["best"][f][b][0] for f in FAMILIES if b in state["best"].get(f, {})]
        if ts:
            out[b] = min(ts)
    return out


def write_table(table: dict[int, Config], E: int, N: int, K: int, dtype: str, out_dir: Path,
                device: str, meta: dict[str, Any] | None = None) -> Path:
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / configs.config_file_name(E, N, K, dtype, device)
    data: dict[str, Any] = {str(k): v for k, v in sorted(table.items())}
    data["triton_version"] = triton.__version__
    data.update(meta or {})
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
