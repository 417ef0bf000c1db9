"""bench_kernels' FP8-format parts (GPU; the correctness part also runs under the interpreter):

  block correctness  block-FP8 ([128, 128] weight blocks, activations per token per 128 columns)
                     in every variant of both paths, bf16 hidden states in and out (and fp8 ones
                     with group scales, as vLLM's prepare step hands them over), into NaN-poisoned
                     outputs, against the float64 reference (exact and group-rounded activations)
                     and against vLLM's own fused_experts(..., block_shape=[128, 128]).
  format bench       ours (the config serving would use) vs vLLM's fused_experts vs the
                     streaming floor of the bytes actually read (fp8 weights plus their scales):
                     bench_kernels.part_bench with these format keys, on FORMAT_SHAPES.
  fp8 aligned        the per-tensor (static scales) and per-token FP8 aligned path forced (not
                     routed) at M = 8..256 vs vLLM, quantize-once (the default) and in the K loop;
                     where the untuned config is vLLM's BLOCK_M = 32 tile (M 33..96), also the
                     candidate tiles of aligned_candidates, each first checked against vLLM's
                     output into a NaN-poisoned buffer.
"""
from __future__ import annotations

import math

import traceback
from typing import Any, Callable

import torch

from moe_serve.kernels.moe import quant_format

BLOCK = quant_format.block_key(128, 128)
FORMAT_SHAPES = {  # the shapes: TP=8 shards of DeepSeek-V3 and Qwen3-235B-A22B, 30B TP1
    "DeepSeek-V3/TP8": (256, 256, 7168, 8),
    "Qwen3-235B-A22B/TP8": (128, 192, 4096, 8),      # N % 128 != 0: gate/up blocks straddle
    "Qwen3-30B-A3B/TP1": (128, 768, 2048, 8),
}
FORMAT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ALIGNED_MS = (8, 16, 32, 48, 64, 96, 128, 256)
TOL_EXACT, TOL_QAWARE = 0.12, 3e-2
# Ours and vLLM's block kernel each round activations to fp8 in their own order, so their outputs
# differ by two independent quantization errors: on the H200 (2026-12-02) ours was 4.5 % from the
# exact product, vLLM's 5.1 %, and the two 6.6 % apart (sqrt(4.5^2 + 5.1^2) = 6.8). vs vLLM a
# result must lie within that noise: err_vs_vllm < VLLM_NOISE x hypot(ours, vLLM's exact errors).
VLLM_NOISE = 1.3
# A candidate tile of the aligned path against vLLM's kernel on the same fp8 problem (same static
# or per-token activation scales, so only accumulation order and fp8 rounding flips differ).
CANDIDATE_TOL = 3e-2


def expert_bytes(N: int, K: int, fmt: str) -> int:
    """Bytes one expert's weights take to read: w1 [2N, K] + w2 [K, N] and their scales."""
    if not quant_format.is_fp8(fmt):
        return 3 * N * K * 2
    bs = quant_format.block_shape(fmt)
    if bs:
        bn, bk = bs
        return 3 * N * K + 4 * (-(-2 * N // bn) * -(-K // bk) + -(-K // bn) * -(-N // bk))
    return 3 * N * K + 4 * (2 * N + K if fmt == quant_format.PER_TOKEN else 2)


def _block_variants(M: int, E: int, N: int, K: int, topk: int, fmt: str) -> dict[str, dict]:
    """Forced configs of every block-FP8 variant at M (decode ones while slots fit)."""
    from moe_serve.kernels.moe import configs, heuristics, selection

    bk = quant_format.block_shape(fmt)[1]
    al = configs.aligned_default(M, E, N, K, topk, fmt)
    out = {"served": selection.get_config(M, E, N, K, topk, fmt),
           "aligned-prequant": al, "aligned-inloop": {**al, "A_PREQUANT": False},
           "aligned-split": {**al, "BLOCK_M": 16, "SWAP_AB": True, "BLOCK_N": 64, "SPLIT_K": 2,
                             "FUSE_GU": False, "DOWN": {**configs.down_config(al), "SPLIT_K": 2,
                                                         "SWAP_AB": True, "BLOCK_N": 64}}}
    if M * topk <= 64:
        dec = heuristics.decode_config(M, E, N, K, topk, fmt)
        out.update({"decode": dec, "decode-prequant": {**dec, "A_PREQUANT": True},
                    "decode-swap": {**dec, "SWAP_AB": True, "BLOCK_N": 64,
                                    "DOWN": {**dec["DOWN"], "SWAP_AB": True, "BLOCK_N": 64}},
                    "decode-epilogue-quant": {**dec, "SWAP_AB": True, "BLOCK_N": bk}})
    return {k: configs.fit(configs.validate(c), fmt, topk=topk) for k, c in out.items()}


def part_block_correctness(shapes: dict, ms: tuple, dev: str, smoke: bool,
                           log: Callable[..., None]) -> list[dict]:
    """See the module doc. smoke (CPU interpreter): fp16 activations (bf16 tl.dot is broken
    there), [32, 32] blocks, no vLLM."""
    from moe_serve.kernels.moe import vllm_kernels
    from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
    from moe_serve.bench.experts.reference import moe_reference, quant_act_groups, quant_fp8_block, rel_err

    block = (32, 32) if smoke else (128, 128)
    fmt = quant_format.block_key(*block)
    fdt = torch.float16 if smoke else torch.bfloat16
    vl = vllm_kernels.fused_experts() if dev == "cuda" else None
    rows = []
    for name, (E, N, K, topk) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(2)
        (q1, s1), (q2, s2) = (quant_fp8_block(torch.randn(E, 2 * N, K, device=dev, generator=g)
                                              * K ** -0.5, *block),
                              quant_fp8_block(torch.randn(E, K, N, device=dev, generator=g)
                                              * N ** -0.5, *block))
        for M in ms:
            x = torch.randn(M, K, device=dev, generator=g).to(fdt)
            tw, ids = torch.softmax(torch.randn(M, E, device=dev, generator=g), -1).topk(topk)
            ids = ids.to(torch.int32)
            kw = dict(w1_scale=s1, w2_scale=s2, block_shape=block)
            ref = moe_reference(x, q1, q2, tw, ids, **kw)
            qref = moe_reference(x, q1, q2, tw, ids, quant_acts="group", **kw)
            theirs = None
            if vl is not None and N % block[0] == 0:   # vLLM's kernel needs whole weight blocks
                fx, qcfg = vl
                theirs = fx(x, q1, q2, tw, ids, quant_config=qcfg(w1_scale=s1, w2_scale=s2,
                                                                  block_shape=list(block)))
            xq, xs = quant_act_groups(x, block[1])
            for vname, cfg in _block_variants(M, E, N, K, topk, fmt).items():
                for x_in, a1 in ((x, None), (xq, xs)) if vname == "served" else ((x, None),):
                    row = dict(shape=name, M=M, variant=vname + ("-fp8in" if a1 is not None else ""))
                    try:
                        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16 if a1 is not None
                                         else fdt, device=dev)
                        fused_moe(x_in, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, block_shape=block),
                                  out=out, config=cfg)
                        row.update(err_exact=rel_err(out, ref), err_qaware=rel_err(out, qref))
                        ok = row["err_exact"] < TOL_EXACT and row["err_qaware"] < TOL_QAWARE
                        if theirs is not None:
                            row.update(err_vs_vllm=rel_err(out, theirs.double()),
                                       vllm_err_exact=rel_err(theirs, ref))
                            ok = ok and row["err_vs_vllm"] < VLLM_NOISE * math.hypot(
                                row["err_exact"], row["vllm_err_exact"])
                        row["ok"] = ok
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:200])
                    rows.append(row)
                    log("[block-correctness] " + " ".join(
                        f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        del q1, q2
    return rows


def aligned_candidates(base: dict[str, Any], E: int, N: int, K: int, topk: int, fmt: str) -> dict[str, dict[str, Any]]:
    """Candidate tiles where the untuned aligned config has BLOCK_M = 32 (vLLM's default tile for
    M 33..96, which vLLM swaps for fp8 on Hopper): 64-row weight tiles swapped (wgmma) with gate
    and up fused (what heuristics.from_vllm_config gives per-tensor and per-token FP8 there) or
    not (vLLM's grid), and the untuned tile of M = 128 (BLOCK_M = 64). Empty for any other
    BLOCK_M."""
    from moe_serve.kernels.moe import configs
    from moe_serve.kernels.moe.config_schema import down_config

    if base["BLOCK_M"] != 32:
        return {}
    down = {**base.get("DOWN", {}), "BLOCK_N": max(64, down_config(base)["BLOCK_N"]), "SWAP_AB": True}
    swap = {**base, "BLOCK_N": 64, "SWAP_AB": True, "DOWN": down}
    out = {"swap": swap, "swap_unfused": {**swap, "FUSE_GU": False},
           "bm64": configs.aligned_default(128, E, N, K, topk, fmt)}
    return {k: configs.fit(configs.validate(c), fmt, topk=topk) for k, c in out.items()}


def _check_vs_vllm(prob: dict, cfg: dict, theirs: torch.Tensor) -> float:
    """Relative error of ours (config cfg, routing set 0, into a NaN-poisoned output) against
    vLLM's output on the same problem."""
    from moe_serve.kernels.moe.fused_moe import fused_moe

    x, tw, ids = prob["sets"][0]
    w1, w2 = prob["weights"][:2]
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w1, w2, tw, ids, fp8=prob["fp8"], out=out, config=cfg)
    return float((out.double() - theirs.double()).norm() / theirs.double().norm())


def _vllm_output(prob: dict) -> torch.Tensor | None:
    """vLLM's fused_experts output on routing set 0 of prob (None without vLLM)."""
    from moe_serve.kernels.moe import vllm_kernels

    fx = vllm_kernels.fused_experts()
    if fx is None:
        return None
    fused_experts, qcfg = fx
    w1, w2, s1, s2 = prob["weights"]
    q = prob["fp8"]
    quant = qcfg(w1_scale=s1, w2_scale=s2, a1_scale=q.a1_scale, a2_scale=q.a2_scale,
                 per_act_token_quant=q.per_token_act, per_out_ch_quant=q.per_token_act,
                 block_shape=None)
    x, tw, ids = prob["sets"][0]
    return fused_experts(x, w1, w2, tw, ids, quant_config=quant)


def part_fp8_aligned(shapes: dict, ms: tuple, n_sets: int, replays: int, dev: str,
                     problem: Callable[..., dict], log: Callable[..., None]) -> list[dict]:
    """See the module doc: per (shape, format, M) ours quantize-once, ours in the K loop and
    vLLM, all on the aligned path's untuned config for the shape (forced, not routed)."""
    from moe_serve.kernels.moe import configs
    from moe_serve.kernels.moe.config_schema import label
    from moe_serve.kernels.tuning import precompile
    from moe_serve.kernels.tuning.timing import time_ours, time_vllm

    fmts = ("fp8", quant_format.PER_TOKEN)
    cfgs: dict[tuple, dict[str, Any]] = {}
    for name, (E, N, K, topk) in shapes.items():
        for fmt in fmts:
            for M in ms:
                base = configs.fit(configs.aligned_default(configs.bucket_of(M), E, N, K, topk, fmt),
                                   fmt, topk=topk)
                cfgs[(name, fmt, M)] = {"once": base, "inloop": {**base, "A_PREQUANT": False},
                                        **aligned_candidates(base, E, N, K, topk, fmt)}
    if dev == "cuda":
        precompile.precompile([(*shapes[n], f, M, c) for (n, f, M), cs in cfgs.items()
                               for c in cs.values()], log=log)
    rows = []
    for name, shape in shapes.items():
        for fmt in fmts:
            weights = None
            for M in ms:
                row: dict[str, Any] = dict(shape=name, dtype=fmt, M=M,
                                           cfg=label(cfgs[(name, fmt, M)]["once"]))
                try:
                    prob = problem(shape, M, fmt, n_sets, weights)
                    weights = prob["weights"]
                    theirs = _vllm_output(prob) if dev == "cuda" else None
                    for tag, cfg in cfgs[(name, fmt, M)].items():
                        if tag not in ("once", "inloop"):
                            row[f"cfg_{tag}"] = label(cfg)
                            if theirs is not None:
                                row[f"err_vs_vllm_{tag}"] = err = _check_vs_vllm(prob, cfg, theirs)
                                if not err < CANDIDATE_TOL:      # NaN (an unwritten row) fails too
                                    continue
                        row[f"ours_{tag}_us"] = time_ours(prob, cfg, replays)
                    vl = time_vllm(prob, replays) if dev == "cuda" else None
                    if vl is not None:
                        row["vllm_us"] = vl
                        row["speedup"] = vl / row["ours_once_us"]
                        row["speedup_inloop"] = vl / row["ours_inloop_us"]
                        for tag in cfgs[(name, fmt, M)]:
                            if tag not in ("once", "inloop") and f"ours_{tag}_us" in row:
                                row[f"speedup_{tag}"] = vl / row[f"ours_{tag}_us"]
                    del prob
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                log("[fp8-aligned] " + " ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            del weights
    return rows


def summary(results: dict[str, Any], log: Callable[..., None]) -> None:
    """The issue's targets, from this run's rows."""
    corr = results.get("block-correctness")
    if isinstance(corr, list) and corr:
        bad = [r for r in corr if not r.get("ok")]
        log(f"block correctness: {len(corr) - len(bad)}/{len(corr)} PASS, max err exact "
            f"{max(r.get('err_exact', float('nan')) for r in corr):.2e}, max vs vLLM "
            f"{max((r['err_vs_vllm'] for r in corr if 'err_vs_vllm' in r), default=float('nan')):.2e}")
        for r in bad:
            log(f"  FAIL {r}")
    rows = results.get("format-bench")
    if isinstance(rows, list):
        for (shp, dt) in dict.fromkeys((r["shape"], r["dtype"]) for r in rows):
            rs = [r for r in rows if (r["shape"], r["dtype"]) == (shp, dt) and "speedup" in r]
            sp = [r["speedup"] for r in rs if r["M"] <= 64]
            if not sp:
                continue
            gm = float(torch.tensor(sp).log().mean().exp())
            m1 = next((r for r in rs if r["M"] == 1), {})
            served = min(r["served_speedup"] for r in rs)
            ok = gm >= 1.3 and served >= 0.98 and ("TP8" not in shp or m1.get("ours_vs_floor", 9) <= 1.3)
            log(f"  {shp:22s} {dt}: geomean M<=64 {gm:.2f}x (target 1.3x), M=1 "
                f"{m1.get('ours_vs_floor', float('nan')):.2f}x the floor, served min {served:.2f}x "
                f"{'OK' if ok else 'SHORT'}")
    rows = results.get("fp8-aligned")
    if isinstance(rows, list):
        for (shp, dt) in dict.fromkeys((r["shape"], r["dtype"]) for r in rows):
            sp = [r["speedup"] for r in rows if (r["shape"], r["dtype"]) == (shp, dt) and "speedup" in r]
            if sp:
                log(f"  aligned {shp:22s} {dt:18s}: min {min(sp):.2f}x vLLM over M 8..256 "
                    f"(target >= 1.0) {'OK' if min(sp) >= 1.0 else 'SHORT'}")
        tags = dict.fromkeys(k[len("cfg_"):] for r in rows for k in r if k.startswith("cfg_"))
        for tag in tags:
            cells = [r for r in rows if f"cfg_{tag}" in r]
            sp = [r[f"speedup_{tag}"] for r in cells if f"speedup_{tag}" in r]
            log(f"  aligned candidate {tag}: {len(sp)}/{len(cells)} cells checked and timed, "
                f"min {min(sp, default=float('nan')):.2f}x vLLM (the default there: min "
                f"{min((r['speedup'] for r in cells if 'speedup' in r), default=float('nan')):.2f}x)")
