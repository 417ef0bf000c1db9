"""`moe-serve bench kernels`: our fused-MoE kernels against vLLM's `fused_experts` and the floor.

    moe-serve bench kernels --model DIR [-tp 8] --out OUT     the MoE shapes of a model at TP
    moe-serve bench kernels --shapes Mixtral-8x7B/TP8,... --formats bf16,fp8 --out OUT
    moe-serve bench kernels --correctness --sass --compiles --out OUT      checks only
    moe-serve bench kernels --fp8-formats --out OUT           block and per-token FP8 (fp8.py)
    TRITON_INTERPRET=1 moe-serve bench kernels --smoke --out OUT            CPU, tiny shapes
    moe-serve bench kernels --dense --model DIR [-tp 8] --out OUT       the dense GEMMs (dense.py)
    moe-serve bench kernels --router --model DIR --out OUT               the router at decode (router.py)

Per (shape, format, M): ours (the config serving would use: its tuned table or the default),
vLLM's `fused_experts` and the streaming floor of the expert bytes the call reads (floor.py), all
replayed from CUDA graphs over input sets rotated beyond L2, after every variant was checked
against float64 into NaN-poisoned outputs (`--correctness`). Results go to OUT/results.json
(rows kernels/tuning/make_routing.py builds routing tables from) and results.md; the per-shape
table (render.py) is printed last. Each part is isolated: a failure prints its traceback and the
others go on.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from moe_serve.bench.experts import fp8 as kernels_fp8
from moe_serve.bench.experts import router
from moe_serve.bench.experts.checks import part_correctness, part_sass, part_sass_subprocess
from moe_serve.bench.experts.compiles import part_compiles
from moe_serve.bench.experts.problem import CUDA, DEV, copy_ceiling, log, problem
from moe_serve.bench.experts.render import shape_table
from moe_serve.bench.experts.shapes import M_LIST, QUICK_MS, SMOKE, TUNED, UNTUNED
from moe_serve.kernels.moe import quant_format

RESULTS: dict[str, Any] = {}       # part -> its rows (or result), saved to OUT after every part
_OUT: Path | None = None


def part_bench(shapes: dict, ms: tuple, dtypes: tuple, ceiling: float, n_sets: int,
               replays: int, tag: str) -> list[dict]:
    """Ours (the config serving would use: tuned table or default), vLLM's fused_experts and
    the streaming floor of the same expert bytes, per (shape, dtype, M), in one run."""
    from moe_serve.bench.experts.floor import floor_us
    from moe_serve.bench.experts.fp8 import expert_bytes
    from moe_serve.kernels.moe import configs, selection
    from moe_serve.kernels.tuning import precompile
    from moe_serve.kernels.moe.config_schema import label
    from moe_serve.kernels.moe.fused_moe import num_programs
    from moe_serve.kernels.tuning.timing import time_ours, time_vllm

    prior = RESULTS.get(tag) if isinstance(RESULTS.get(tag), list) else []   # an earlier format's rows
    rows: list[dict] = []
    floors: dict[int, float] = {}
    if CUDA:  # compile every config this part will hit on the host CPU, in parallel
        precompile.precompile([(*shape, dt, M, selection.get_config(M, *shape, dt))
                               for shape in shapes.values() for dt in dtypes for M in ms], log=log)
    for name, shape in shapes.items():
        E, N, K, topk = shape
        for dt in dtypes:
            weights = None
            tuned = configs.load_table(E, N, K, dt, configs.device_name()) is not None
            for M in ms:
                row = dict(part=tag, shape=name, dtype=dt, M=M, tuned=tuned)
                cfg = selection.get_config(M, E, N, K, topk, dt)
                row["cfg"] = label(cfg)
                row["ctas"] = "%d/%d" % num_programs(M, E, N, K, topk, cfg)
                row["route"] = selection.route(E, N, K, dt, M, topk=topk)  # what serving uses
                try:
                    prob = problem(shape, M, dt, n_sets, weights)
                    weights = prob["weights"]
                    ebytes = expert_bytes(N, K, dt)          # fp8: weights + their scales
                    hit = sum(len(torch.unique(ids)) for _, _, ids in prob["sets"]) / n_sets
                    row["ours_us"] = time_ours(prob, None, replays)
                    row["gbytes_hit"] = hit * ebytes / 1e9
                    row["ours_bw_frac"] = hit * ebytes / (row["ours_us"] * 1e-6) / ceiling
                    if CUDA:
                        nb = int(hit * ebytes)
                        key = round(nb, -5)                  # floors within 100 kB shared
                        if key not in floors:
                            floors[key] = floor_us(nb, replays)["floor_us"]
                        row["floor_us"] = floors[key]
                        row["ours_vs_floor"] = row["ours_us"] / row["floor_us"]
                    try:
                        vl = time_vllm(prob, replays) if CUDA else None
                    except Exception as e:  # noqa: BLE001
                        vl = None
                        row["vllm_error"] = f"{type(e).__name__}: {e}"[:200]
                    if vl is not None:
                        row["vllm_us"] = vl
                        row["speedup"] = vl / row["ours_us"]
                        row["served_speedup"] = row["speedup"] if row["route"] == "ours" else 1.0
                        row["vllm_bw_frac"] = hit * ebytes / (vl * 1e-6) / ceiling
                        if "floor_us" in row:
                            row["vllm_vs_floor"] = vl / row["floor_us"]
                    del prob
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                log(f"[{tag}] " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k != "part"))
            del weights
            if CUDA:
                torch.cuda.empty_cache()
            RESULTS[tag] = prior + rows           # partial results survive a time-out kill
            if _OUT is not None:
                _save(_OUT)
    return prior + rows


# ----------------------------------------------------------------------------------------
def _md_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    md = [f"# bench_kernels ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"{torch.cuda.get_device_name() if CUDA else 'cpu'})"]
    for k, v in RESULTS.items():
        md.append(f"\n## {k}\n")
        md.append(_md_table(v) if isinstance(v, list) else f"```\n{json.dumps(v, default=str)}\n```")
    (out / "results.md").write_text("\n".join(md) + "\n")


def _run(name: str, fn, *a, **kw) -> None:
    t0 = time.perf_counter()
    log(f"==== {name} ====")
    try:
        RESULTS[name] = fn(*a, **kw)
    except Exception as e:  # noqa: BLE001  one failing part must not kill the others
        traceback.print_exc()
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
    log(f"==== {name} done in {time.perf_counter() - t0:.1f}s ====")
    if _OUT is not None:
        try:  # partial results survive a timeout kill of a later part
            _save(_OUT)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def _summary() -> None:
    log("\n===== summary =====")
    for r in RESULTS.get("correctness", []) if isinstance(RESULTS.get("correctness"), list) else []:
        if not r["ok"]:
            log(f"FAIL correctness {r}")
    corr = RESULTS.get("correctness")
    if isinstance(corr, list):
        log(f"correctness: {sum(r['ok'] for r in corr)}/{len(corr)} PASS, "
            f"max err {max((r['rel_err'] for r in corr), default=0):.2e}")
    if isinstance(RESULTS.get("sass"), list):
        for r in RESULTS["sass"]:
            log(f"sass {r['dtype']} swap={r['swap']} {r['gemm']}: {r['mma']} "
                f"{'OK' if r['ok'] else 'UNEXPECTED'}")
    for part in ("bench", "quick-bench", "untuned", "format-bench"):
        rows = RESULTS.get(part)
        if isinstance(rows, list):
            _bench_summary(part, rows)
    if "compiles" in RESULTS:
        log(f"compiles: {RESULTS['compiles']}")
    kernels_fp8.summary(RESULTS, log)


def _bench_summary(part: str, rows: list[dict]) -> None:
    """Per cell: ours, vLLM, floor, ratios, route; then per (shape, dtype) geomeans at M <= 64
    against the targets, and the served minimum (vLLM's kernel where routed to vLLM)."""
    nan = float("nan")
    log(f"{part}: shape dtype M | ours_us vllm_us floor_us | speedup ours/floor vllm/floor | "
        f"route served | cfg")
    for r in rows:
        log(f"  {r['shape']:22s} {r['dtype']:4s} {r['M']:5d} | {r.get('ours_us', nan):8.1f} "
            f"{r.get('vllm_us', nan):8.1f} {r.get('floor_us', nan):8.1f} | "
            f"{r.get('speedup', nan):5.2f} {r.get('ours_vs_floor', nan):5.2f} "
            f"{r.get('vllm_vs_floor', nan):5.2f} | {r.get('route', ''):4s} "
            f"{r.get('served_speedup', nan):5.2f} | {r.get('cfg', '')}"
            f"{'  ERROR ' + r['error'] if 'error' in r else ''}")
    groups: dict = {}
    for r in rows:
        if "speedup" in r:
            groups.setdefault((r["shape"], r["dtype"], r.get("tuned", False)), []).append(r)
    for (shp, dt, tuned), rs in groups.items():
        sp = [r["speedup"] for r in rs if r["M"] <= 64]
        if not sp:
            continue
        gm = float(torch.tensor(sp).log().mean().exp())
        target = (1.5 if dt == "fp8" else 1.1) if tuned else 1.0
        served = min(r["served_speedup"] for r in rs)
        log(f"  geomean M<=64 {shp:22s} {dt:4s} {'tuned' if tuned else 'default'} {gm:5.2f}x "
            f"(target {target}x) min {min(sp):.2f}x; served min over all M {served:.2f}x "
            f"{'OK' if gm >= target and served >= 0.98 else 'SHORT'}")
    for r in rows:
        if r.get("served_speedup", 1.0) < 0.98:
            log(f"  served < 0.98x: {r['shape']} {r['dtype']} M={r['M']} {r['served_speedup']:.2f}x")


def _fp8_formats(args: argparse.Namespace, ms: tuple | None) -> None:
    """--fp8-formats (or its parts): bench/kernels_fp8's block correctness, the format bench
    (block and per-token FP8 on FORMAT_SHAPES) and the forced aligned path."""
    every = args.fp8_formats
    shapes = {k: v for k, v in kernels_fp8.FORMAT_SHAPES.items()
              if not args.shapes or k in args.shapes.split(",")}
    if every or args.format_bench:
        if "ceiling" not in RESULTS:
            _run("ceiling", copy_ceiling)
    ceiling = (RESULTS.get("ceiling") or {}).get("copy_bytes_per_s", float("nan"))
    if every or args.block_correctness:
        _run("block-correctness", kernels_fp8.part_block_correctness, shapes, ms or (1, 7, 33),
             DEV, False, log)
    if every or args.format_bench:
        _run("format-bench", part_bench, shapes, ms or kernels_fp8.FORMAT_MS,
             (kernels_fp8.BLOCK, quant_format.PER_TOKEN), ceiling, args.sets, args.replays,
             "format-bench")
    if every or args.fp8_aligned:
        aligned = {k: v for k, v in {**UNTUNED, **kernels_fp8.FORMAT_SHAPES}.items()
                   if k in (args.shapes.split(",") if args.shapes else
                            ("Mixtral-8x22B/TP8", "OLMoE", "Phi-3.5-MoE/TP8", "Qwen3-235B-A22B/TP8"))}
        _run("fp8-aligned", kernels_fp8.part_fp8_aligned, aligned, ms or kernels_fp8.ALIGNED_MS,
             args.sets, args.replays, DEV, problem, log)


def model_shapes(model: str, tp: int, quantization: str | None) -> dict[str, dict[str, tuple]]:
    """format -> {shape name: (E, N, K, top-k)} of one rank of a model dir at tensor-parallel size tp."""
    from moe_serve.kernels.tuning.model_shapes import moe_shapes, read_config

    out: dict[str, dict[str, tuple]] = {}
    for sh in moe_shapes(read_config(model), tp, quantization, name=Path(model).name):
        out.setdefault(sh.dtype, {})[sh.name] = sh.key
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe-serve bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Time on one H200: ~1.5 min for 6 shapes x 2 formats x 5 M with --quick; "
                                        "correctness ~1 min per shape; compiles ~1 min; --dense ~3-6 min per model "
                                        "(mostly the search's compiles; ~1 min with --no-dense-sweep).")
    ap.add_argument("--model", help="a model directory (config.json): bench its MoE shapes in its own format")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="with --model: shapes of one rank")
    ap.add_argument("--quantization", choices=["fp8", "compressed-tensors"], default=None,
                    help="with --model: vLLM's --quantization (default: the checkpoint's own)")
    ap.add_argument("--shapes", default=None, help="comma list of named shapes (bench/experts/shapes.py); "
                                                   "default without --model: the tuned ones")
    ap.add_argument("--formats", default="bf16,fp8", help="with --shapes: moe_serve.kernels.moe.quant_format keys")
    ap.add_argument("--ms", default=None, help=f"M list (default {','.join(map(str, M_LIST))}; --quick: "
                                               f"{','.join(map(str, QUICK_MS))})")
    ap.add_argument("--quick", action="store_true", help="the short M list")
    ap.add_argument("--no-bench", dest="bench", action="store_false", help="checks only, no timing")
    ap.add_argument("--correctness", action="store_true", help="every variant against float64 first (M 1, 7, 33)")
    ap.add_argument("--sass", action="store_true", help="HGMMA/QGMMA and atomics in the compiled SASS (GPU)")
    ap.add_argument("--compiles", action="store_true", help="Triton compiles while M sweeps 1..512 after warm-up")
    ap.add_argument("--fp8-formats", action="store_true", help="block and per-token FP8 parts (fp8.py)")
    ap.add_argument("--smoke", action="store_true", help="every part on tiny shapes (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--dense", action="store_true", help="only the dense GEMMs of a decode step (dense.py): our "
                    "GEMV vs F.linear (cuBLAS) vs the floor at M 1, 2, 4, 8, and a config search per cell")
    ap.add_argument("--dense-shapes", default=None, help="with --dense and no --model: comma list of named "
                    "shapes (kernels/tuning/dense_shapes.py; default qwen3-30b-a3b/tp1,mixtral-8x7b/tp1)")
    ap.add_argument("--no-dense-sweep", dest="sweep", action="store_false", help="with --dense: no config search")
    router.add_args(ap)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sets", type=int, default=8, help="input sets rotated per graph")
    ap.add_argument("--replays", type=int, default=20)
    # the --fp8-formats parts one by one
    for part in ("block-correctness", "format-bench", "fp8-aligned"):
        ap.add_argument(f"--{part}", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def smoke() -> None:
    """Every part on the tiny shapes (the interpreter on CPU)."""
    _run("correctness", part_correctness, SMOKE, (1, 5), smoke=True)
    _run("sass", part_sass_subprocess, _OUT)
    _run("bench", part_bench, SMOKE, (1, 4), ("bf16", "fp8"), float("nan"), 2, 3, "bench")
    _run("compiles", part_compiles, SMOKE["tiny-a"], "fp8", 12)
    _run("block-correctness", kernels_fp8.part_block_correctness, {"tiny-a": SMOKE["tiny-a"]},
         (1, 9), DEV, True, log)
    _run("format-bench", part_bench, {"tiny-a": SMOKE["tiny-a"]}, (1, 8),
         (quant_format.block_key(32, 32), quant_format.PER_TOKEN), float("nan"), 2, 3, "format-bench")
    _run("fp8-aligned", kernels_fp8.part_fp8_aligned, {"tiny-a": SMOKE["tiny-a"]}, (8,), 2, 3, DEV, problem, log)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global _OUT
    _OUT = args.out
    args.out.mkdir(parents=True, exist_ok=True)
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        log("moe-serve bench kernels: no CUDA GPU visible (on CPU, TRITON_INTERPRET=1 with --smoke)")
        return 2
    if args.dense:
        from moe_serve.bench.experts import dense

        return dense.main(args, RESULTS, lambda: _save(args.out))
    if args.router:
        return router.main(args, RESULTS, lambda: _save(args.out))
    t0 = time.perf_counter()
    if args.smoke:
        smoke()
    else:
        if args.model:
            groups = model_shapes(args.model, args.tensor_parallel_size, args.quantization)
        else:
            named = {**TUNED, **UNTUNED}
            wanted = args.shapes.split(",") if args.shapes else list(TUNED)
            if unknown := [n for n in wanted if n not in named]:
                log(f"unknown shapes {unknown}; named: {', '.join(named)}")
                return 2
            groups = {f: {n: named[n] for n in wanted} for f in args.formats.split(",")}
        ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else (QUICK_MS if args.quick else M_LIST)
        if args.correctness:
            every = {n: k for shapes in groups.values() for n, k in shapes.items()}
            _run("correctness", part_correctness, every, ms if args.ms else (1, 7, 33), smoke=False)
        if args.sass:
            _run("sass", part_sass, args.out)
        if args.compiles:
            _run("compiles", part_compiles, TUNED["Mixtral-8x7B/TP8"], "bf16", 512)
        if args.bench:
            _run("ceiling", copy_ceiling)
            ceiling = (RESULTS.get("ceiling") or {}).get("copy_bytes_per_s", float("nan"))
            for fmt, shapes in groups.items():
                _run("bench", part_bench, shapes, ms, (fmt,), ceiling, args.sets, args.replays, "bench")
        _fp8_formats(args, ms if args.ms else None)
    _save(args.out)
    _summary()
    if isinstance(RESULTS.get("bench"), list) and RESULTS["bench"]:
        log("\n".join(shape_table(args.out / "results.json")))
    log(f"total {time.perf_counter() - t0:.0f}s; results in {args.out}/results.md")
    return 0


def tune_dense(args: argparse.Namespace, out: Path, force: bool) -> int:
    """`moe-serve tune`'s dense step (kernels/tuning/tune_cli.py): the model's dense GEMMs searched
    as `moe-serve bench kernels --dense --model` does, rows in out/dense-search/, the tables (the
    buckets where ours won) copied into out, where the server reads them. Skipped when an earlier
    run finished its search there, unless force."""
    search = out / "dense-search"
    if (search / "results.json").is_file() and not force:
        print(f"[tune] dense GEMMs: already searched ({search}); --force to search again", file=sys.stderr)
        return 0
    argv = ["--dense", "--model", str(args.model), "-tp", str(args.tensor_parallel_size), "--out", str(search),
            *(["--quantization", args.quantization] if args.quantization else []),
            *(["--ms", args.dense_ms] if args.dense_ms else [])]
    rc = main(argv)
    tables = sorted((search / "dense-tables").glob("*.json"))
    for table in tables:
        shutil.copyfile(table, out / table.name)
    print(f"[tune] dense GEMMs: {len(tables)} table(s) into {out} (rows: {search / 'results.json'})", flush=True)
    return rc
