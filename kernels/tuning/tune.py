"""Search fused-MoE configs for one shape on the GPU, timed under CUDA-graph replay.

Per M bucket two families compete, each starting from its default and walked one dimension
at a time (phases), every phase's new candidates compiled for sm_90 on the host CPU first
(moe_serve.kernels.tuning.precompile), then timed:
  decode (buckets with M * topk <= 64, moe_serve.kernels.moe.moe_decode): up tile, up BLOCK_K, up stages,
      down tile, down stages, up split-K, down split-K, PDL, the down weights' L2 prefetch
      (fp8: and A_PREQUANT); after the aligned phases, two joint grids (up: split-K x stages x
      BLOCK_K; down: tile x BLOCK_K x split-K x stages), where single-dimension walks cannot
      trade programs for occupancy;
  gemv (buckets with M * topk <= 32, moe_serve.kernels.moe.moe_gemv: the decode path on CUDA cores): up
      tile (rows x K step), up warps x split-K, down tile, down warps x split-K, stages, PDL;
  aligned (every bucket): A GEMM1 split/fuse, B GEMM1 tiles (fp8: and A_PREQUANT), C GEMM2;
  then D: each bucket tries its neighbours' winners (one-dimension walks stop at local
  optima). The fastest family wins the bucket.
`dtype` is the layer's moe_serve.kernels.moe.quant_format key: each format is tuned on its own (block FP8
candidates keep BLOCK_K = the activation group, so its BLOCK_K walks collapse).
Candidates (moe_serve.kernels.tuning.candidates) are pruned statically first (tl.dot dims >= 16, swapped
tiles 64-row, shared memory <= 227 KB; GEMV tiles no larger than the padded dims). A time budget stops the search and keeps the best so far; `state` (a
dict the caller may persist) lets an interrupted search resume after its last phase.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moe_serve.kernels.moe import configs, heuristics, quant_format
from moe_serve.kernels.moe.config_schema import Config, prequant
from moe_serve.kernels.tuning import precompile
from moe_serve.kernels.tuning.candidates import (aligned_a, aligned_b, aligned_c, decode_down_occupancy,
                                       decode_down_tiles, decode_prefetch, decode_up_occupancy,
                                       decode_up_tiles, gemv_down_occupancy, gemv_down_tiles,
                                       gemv_stages, gemv_up_occupancy, gemv_up_tiles, legal_unique,
                                       vary)
from moe_serve.kernels.tuning.timing import make_problem, time_ours

DECODE_TUNE_MAX_SLOTS = 64
GEMV_TUNE_MAX_SLOTS = 32
FAMILIES = ("decode", "gemv", "aligned")


PHASES: list[tuple[str, str, Callable[..., list[dict]]]] = [  # (name, family, candidates)
    ("decode up tile", "decode", lambda c, s: decode_up_tiles(c)),
    ("decode up BLOCK_K", "decode", lambda c, s: vary(c, "BLOCK_K", (64, 128, 256))),
    ("decode up stages", "decode", lambda c, s: vary(c, "num_stages", (3, 4, 5, 6))),
    ("decode down tile", "decode", lambda c, s: decode_down_tiles(c)),
    ("decode down stages", "decode", lambda c, s: vary(c, "num_stages", (3, 4, 5, 6), down=True)),
    ("decode up split", "decode", lambda c, s: vary(c, "SPLIT_K", (1, 2, 4, 8))),
    ("decode down split", "decode", lambda c, s: vary(c, "SPLIT_K", (1, 2, 4, 8, 16), down=True)),
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
