"""Investigation: where the two-launch decode path stands against the memory floor.

For each (shape, dtype, M) cell with M * topk <= 128 it times, under CUDA-graph replay on
8 rotating input sets, the aligned path (selection.get_config), the decode heuristic
(heuristics.decode_config), and a coordinate search over decode configs (phases: up-kernel
tile, BLOCK_K, stages, down-kernel tile, down stages, PDL), plus the streaming floor
of the cell's expert bytes. Phase-major: each phase's new variants for all cells are
compiled for sm_90 in a host process pool first. Writes $OUT/decode_sweep.json.
(The run in bench/results/2026-12-01/decode_sweep was made at commit 747e918, whose decode
path still had a split-K variant: every split-K cell was 2-20x slower, so it was removed.)

    python bench/investigations/decode_sweep.py --out $OUT --budget-s 480
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

from floor import floor_us  # noqa: E402
from shapes import TUNED, UNTUNED  # noqa: E402
from kernels.moe import configs, heuristics, selection  # noqa: E402
from kernels.tuning import tune  # noqa: E402

SHAPES = {**TUNED, **UNTUNED}  # name: (E, N per rank, K hidden, topk)
MS = (1, 2, 4, 8, 16, 32, 64)
T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:6.0f}s]", *a, flush=True)


def cfg_str(c: dict) -> str:
    d = c["DOWN"]
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}{'s' if c['SWAP_AB'] else ''}"
            f"/sk{c['SPLIT_K']}/st{c['num_stages']}|d{d['BLOCK_N']}x{d['BLOCK_K']}"
            f"{'s' if d['SWAP_AB'] else ''}/st{d['num_stages']}/w{c['num_warps']}"
            f"{'/pdl' if c.get('PDL') else ''}")


def up_tiles(c: dict, N: int) -> list[dict]:
    out = []
    for swap, bn in ((False, 16), (False, 32), (False, 64), (True, 64), (True, 128)):
        if bn <= max(16, 1 << (N - 1).bit_length()):
            out.append({**c, "SWAP_AB": swap, "BLOCK_N": bn})
    return out


def vary(c: dict, key: str, values, down: bool = False) -> list[dict]:
    if down:
        return [{**c, "DOWN": {**c["DOWN"], key: v}} for v in values if v != c["DOWN"][key]]
    return [{**c, key: v} for v in values if v != c[key]]


def down_tiles(c: dict, N: int) -> list[dict]:
    out = []
    for swap, bn in ((False, 16), (False, 32), (False, 64), (True, 64)):
        for bk in (64, 128, 256):
            if bk > max(16, 1 << (N - 1).bit_length()):
                continue
            out.append({**c, "DOWN": {**c["DOWN"], "SWAP_AB": swap, "BLOCK_N": bn,
                                      "BLOCK_K": bk}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shape")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        SHAPES["tiny"] = (8, 32, 64, 2)
        args.shapes, args.replays = "tiny", 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "triton": __import__("triton").__version__,
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "cells": []}
    try:
        import triton.language.extra.cuda as tlc
        res["pdl_available"] = hasattr(tlc, "gdc_wait")
    except Exception as e:  # noqa: BLE001
        res["pdl_available"] = repr(e)
    cells, weights, probs = [], {}, {}
    for name in args.shapes.split(","):
        E, N, K, topk = SHAPES[name]
        for dt in args.dtypes.split(","):
            for M in (MS if not args.smoke else (1, 3)):
                if M * topk <= 128:
                    cells.append({"shape": name, "E": E, "N": N, "K": K, "topk": topk,
                                  "dtype": dt, "M": M, "timings": {}})

    def prob(c: dict) -> dict:
        key = (c["shape"], c["dtype"], c["M"])
        if key not in probs:
            wk = (c["shape"], c["dtype"])
            p = tune.make_problem(c["E"], c["N"], c["K"], c["topk"], c["M"], c["dtype"], 8,
                                  dev, seed=c["M"], weights=weights.get(wk))
            weights[wk] = p["weights"]
            probs[key] = p
        return probs[key]

    def time_cfg(c: dict, cfg: dict) -> float:
        k = cfg_str(cfg)
        if k in c["timings"]:
            return c["timings"][k]
        try:
            t = tune.time_ours(prob(c), configs.validate(cfg), args.replays)
        except Exception as e:  # noqa: BLE001
            c.setdefault("errors", {})[k] = f"{type(e).__name__}: {str(e)[:160]}"
            if dev == "cuda":
                torch.cuda.synchronize()
            t = float("inf")
        c["timings"][k] = t
        return t

    def save() -> None:
        (out / "decode_sweep.json").write_text(json.dumps(res, indent=1, default=str))

    res["cells"] = cells
    # ---- baseline: floor, aligned path, heuristic ------------------------------------------
    for c in cells:
        E, N, K, topk, M, dt = c["E"], c["N"], c["K"], c["topk"], c["M"], c["dtype"]
        p = prob(c)
        hit = sum(len(torch.unique(ids)) for _, _, ids in p["sets"]) / len(p["sets"])
        c["bytes_hit"] = hit * 3 * N * K * (1 if dt == "fp8" else 2)
        c.update(floor_us(int(c["bytes_hit"])) if dev == "cuda" else {"floor_us": float("nan")})
        try:
            c["aligned_us"] = tune.time_ours(p, selection.get_config(M, E, N, K, topk, dt),
                                             args.replays)
        except Exception as e:  # noqa: BLE001
            c["aligned_error"] = repr(e)[:200]
        c["heur"] = heuristics.decode_config(M, E, N, K, topk, dt)
        c["best"] = c["heur"]
    log(f"baselines for {len(cells)} cells")
    if dev == "cuda":
        tune.precompile([(c["E"], c["N"], c["K"], c["topk"], c["dtype"], c["M"], c["heur"])
                         for c in cells], log=log)
    for c in cells:
        c["heur_us"] = c["best_us"] = time_cfg(c, c["heur"])
    save()

    phases = [
        ("up tiles", lambda c: up_tiles(c["best"], c["N"])),
        ("up BLOCK_K", lambda c: vary(c["best"], "BLOCK_K", [b for b in (64, 128, 256)
                                      if b <= max(16, 1 << (c["K"] - 1).bit_length())])),
        ("up stages", lambda c: vary(c["best"], "num_stages", (3, 4, 5, 6))),
        ("down tiles", lambda c: down_tiles(c["best"], c["N"])),
        ("down stages", lambda c: vary(c["best"], "num_stages", (2, 3, 4, 5, 6), down=True)),
        ("up warps", lambda c: vary(c["best"], "num_warps", (4, 8))),
        ("pdl", lambda c: [{**c["best"], "PDL": not c["best"].get("PDL", False)}]),
    ]
    for pname, make in phases:
        if time.perf_counter() - T0 > args.budget_s:
            log(f"budget spent before phase {pname}")
            break
        cand = {id(c): [configs.validate(x) for x in make(c)] for c in cells}
        if dev == "cuda":
            tune.precompile([(c["E"], c["N"], c["K"], c["topk"], c["dtype"], c["M"], x)
                             for c in cells for x in cand[id(c)]], log=log)
        for c in cells:
            if time.perf_counter() - T0 > args.budget_s:
                break
            for x in cand[id(c)]:
                t = time_cfg(c, x)
                if t < c["best_us"]:
                    c["best_us"], c["best"] = t, x
        log(f"phase {pname} done")
        save()
    tune.shutdown_pool()
    for c in cells:
        c["best_cfg"] = cfg_str(c["best"])
        log(f"{c['shape']:24s} {c['dtype']:4s} M={c['M']:3d} floor {c['floor_us']:6.1f} "
            f"aligned {c.get('aligned_us', float('nan')):6.1f} heur {c['heur_us']:6.1f} "
            f"best {c['best_us']:6.1f} ({c['best_us'] / c['floor_us']:.2f}x floor) "
            f"{c['best_cfg']}")
    save()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
