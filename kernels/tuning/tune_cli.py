"""`moe-serve tune`: tune our fused-MoE kernels for a model's MoE shapes on this GPU.

    moe-serve tune --model DIR [--tensor-parallel-size N] [--quantization fp8|compressed-tensors]
                   [--budget-minutes M] [--out DIR] [--no-vllm] [--force] [--refine PHASES]

Reads DIR/config.json (no weights), derives the shapes one rank runs and their format (its
quantization_config as vLLM reads it, --quantization overriding the method: per-tensor 'fp8',
block 'fp8_w8a8,block_shape=[128,128]', per-token 'fp8_w8a8,per_token': moe_serve.kernels.moe.quant_format;
each format is tuned and routed on its own), searches configs for
every M bucket (moe_serve.kernels.tuning.tune) within the budget, then times ours against vLLM's
fused_experts at M = 1..4096 and writes the configs and the routing table (ours only where
measured faster beyond the run-to-run spread: moe_serve.kernels.tuning.make_routing) into the cache the
server reads first ($MOE_SERVE_CACHE/kernels/<device>/triton-<version>, or --out). Then, from
`moe-serve tune` (unless --no-dense), the model's dense GEMMs are searched as `moe-serve bench
kernels --dense` does, and their tables go to the same place (OUT/dense-search/ keeps the rows).
Interrupted runs resume after their last finished phase; a shape already tuned is skipped
unless --force. --refine "decode prefetch[,...]" runs only those search phases on each shape's
table in use (moe_serve.kernels.tuning.refine), writes the refined table to the cache (or --out), and
keeps the routing as it is: a refined config is never slower than the one routed.
`--for-vllm` tunes vLLM's own fused-MoE kernel instead, for plain `vllm serve`
(moe_serve.kernels.tuning.vllm_tune; `moe-serve tune --for-vllm --help`).
Exit codes: 0 done, 1 a dense cell failed (its row says why), 2 no GPU / bad model / no table to refine /
unknown phase.
On a CPU with TRITON_INTERPRET=1 the whole pipeline runs (for tests), timed by wall clock.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moe_serve.kernels.moe import configs, routing, selection, vllm_kernels
from moe_serve.kernels.tuning import make_routing, precompile, refine, tune
from moe_serve.kernels.moe.config_schema import label
from moe_serve.kernels.tuning.model_shapes import ModelConfigError, MoEShape, model_parser, moe_shapes, read_config
from moe_serve.kernels.tuning.timing import make_problem, time_ours, time_vllm

ROUTE_MS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
            2048, 4096)
ROUTE_SHARE = 0.25          # of the budget kept for timing vLLM and writing the routing


class Progress:
    """One status line per step on stderr, with elapsed time and the budget-bound ETA."""

    def __init__(self, total_s: float) -> None:
        self.t0, self.total_s = time.perf_counter(), total_s
        self.tty = sys.stderr.isatty()

    def show(self, what: str, frac: float) -> None:
        el = time.perf_counter() - self.t0
        eta = max(0.0, min(self.total_s - el, el / frac - el if frac > 0 else self.total_s))
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = f"[tune] [{bar}] {100 * frac:5.1f}% {el:6.0f}s elapsed, ETA {eta:5.0f}s  {what}"
        print(("\r" + line[:150]) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _partial_path(out: Path, shape: MoEShape, device: str) -> Path:
    return out / ".partial" / configs.config_file_name(*shape.key[:3], shape.dtype, device)


def _route_shape(shape: MoEShape, device_kind: str, replays: int, deadline: float,
                 use_vllm: bool, max_m: int) -> dict[str, Any]:
    """Ours (with the new table) vs vLLM at ROUTE_MS <= max_m; the shape's routing entry."""
    E, N, K, topk = shape.key
    entry = {"name": shape.name, "topk": topk}
    default = {**entry, "measured": {}, "ranges": routing.default_ranges(E, N, K, topk),
               "rule": "default rule (vLLM not timed)"}
    if not use_vllm:
        return default
    measured: dict[str, Any] = {}
    weights = None
    for M in (m for m in ROUTE_MS if m <= max_m):
        if time.perf_counter() > deadline:
            break
        prob = make_problem(E, N, K, topk, M, shape.dtype, 8, device_kind, seed=M, weights=weights)
        weights = prob["weights"]
        cfg = selection.get_config(M, E, N, K, topk, shape.dtype)
        point: dict[str, Any] = {"ours_us": None, "vllm_us": None, "speedup": None, "cfg": label(cfg)}
        try:
            point["ours_us"] = time_ours(prob, None, replays)
        except Exception as e:  # noqa: BLE001 - a failing config of ours: that M stays vLLM's
            point["error"] = f"{type(e).__name__}: {e}"[:160]
        if point["ours_us"] is not None:
            try:
                point["vllm_us"] = time_vllm(prob, replays)
            except Exception as e:  # noqa: BLE001 - vLLM's kernel cannot run the shape (e.g. block
                point["vllm_error"] = f"{type(e).__name__}: {e}"[:160]  # FP8 N % 128 != 0)
            if point["vllm_us"] is not None:
                point["speedup"] = round(point["vllm_us"] / point["ours_us"], 4)
        measured[str(M)] = point
        del prob
    if not measured:                             # budget spent before the first M
        return default
    ranges = make_routing.route_measured(measured)
    return {**entry, "measured": measured, "ranges": ranges, "rule": "measured"}


def _write_routing(out: Path, device: str, entries: dict[str, Any]) -> Path:
    path = out / routing.file_name(device)
    table = json.loads(path.read_text()) if path.is_file() else {
        "device": device, "triton_version": configs.running_triton_version(),
        "spread": make_routing.DEFAULT_SPREAD, "spread_from": "default (one reading per M)",
        "sources": ["moe-serve tune"], "rule": make_routing.RULE, "shapes": {}}
    table["shapes"].update(entries)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def _summary(shape: MoEShape, ent: dict[str, Any], seconds: float) -> str:
    sp = {int(m): v["speedup"] for m, v in ent["measured"].items()}
    at = ", ".join(f"M={m} {sp[m]:.2f}x" if sp.get(m) else
                   f"M={m} vLLM failed" if ent["measured"].get(str(m), {}).get("vllm_error") else
                   f"M={m} n/a" for m in (1, 8, 64))
    ours = ",".join(f"{r['m_min']}-{r['m_max'] or ''}" for r in ent["ranges"]
                    if r["backend"] == routing.OURS) or "none"
    return (f"[tune] {shape.name} E={shape.E} N={shape.N} K={shape.K} topk={shape.topk} "
            f"{shape.dtype}: tuned in {seconds:.0f}s; vs vLLM {at}; ours for M in {ours}")


def seed_warning(device_kind: str) -> str | None:
    """A warning when tuning on a GPU without vLLM importable: the aligned search then starts
    from our heuristic instead of vLLM's config for the shape (configs.aligned_default), which
    is what the server would run untuned, so the tables can lose to no table at all."""
    if device_kind != "cuda" or vllm_kernels.fused_experts() is not None:
        return None
    return ("moe-serve tune: vLLM is not importable here, so the search cannot start from "
            "vLLM's config for each shape, which the server uses when a shape has no table, "
            "so its tables can be slower than none (seen on an H200). Tune where vLLM is installed.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = model_parser("moe-serve tune", __doc__)
    ap.add_argument("--budget-minutes", type=float, default=10.0)
    ap.add_argument("--out", default=None, help="default: the server's tuned-config cache")
    ap.add_argument("--buckets", default=",".join(map(str, configs.M_BUCKETS)))
    ap.add_argument("--no-vllm", action="store_true", help="do not time vLLM (default routing)")
    ap.add_argument("--force", action="store_true", help="re-tune shapes already tuned")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--for-vllm", action="store_true",
                    help="tune vLLM's own fused-MoE kernel into vLLM's table format for plain "
                         "`vllm serve` (VLLM_TUNED_CONFIG_FOLDER); its options: --for-vllm --help")
    ap.add_argument("--no-dense", dest="dense", action="store_false",
                    help="skip the dense GEMMs' search (QKV, O, MLP, lm_head in the model's formats; "
                         "after the MoE shapes, a few minutes outside --budget-minutes)")
    ap.add_argument("--dense-ms", default=None, help="the dense search's token counts (default: its own, 1..16)")
    ap.add_argument("--refine", default=None, metavar="PHASES",
                    help="comma-separated search phases to run on the tables in use, e.g. "
                         "'decode prefetch' (no full search, routing kept)")
    return ap.parse_args(argv)


def _refine(shapes: list[MoEShape], phases: list[str], out: Path, device: str,
            device_kind: str, buckets: tuple[int, ...], budget: float) -> int:
    """--refine: each shape's table in use through `phases`; the refined tables into out."""
    t_start = time.perf_counter()
    done = 0
    for i, shape in enumerate(shapes):
        E, N, K, topk = shape.key
        found = configs.find_table(E, N, K, shape.dtype, device)
        if found.table is None:
            print(f"[tune] {shape.name} {shape.dtype}: no table to refine; run `moe-serve tune` "
                  f"without --refine first", file=sys.stderr)
            continue
        print(f"[tune] refining {shape.name} {shape.dtype} ({found.source}: {found.path}) with "
              f"{', '.join(phases)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        left = budget - (t0 - t_start)
        table, report = refine.refine_table(
            E, N, K, topk, shape.dtype, found.table, phases, buckets, left / (len(shapes) - i),
            device_kind, log=lambda line: print(line, file=sys.stderr, flush=True))
        meta = {k: v for k, v in json.loads(found.path.read_text()).items() if not k.isdigit()}
        meta.pop("triton_version", None)
        meta["refined"] = {"phases": phases, "from": found.source, "seconds":
                           round(time.perf_counter() - t0), "buckets": report}
        path = tune.write_table(table, E, N, K, shape.dtype, out, device, meta)
        selection.clear_caches()
        gained = [f"M={b} {r['before_us']:.1f}->{r['after_us']:.1f}us" for b, r in report.items()
                  if r["before"] != r["after"]]
        print(f"[tune] {shape.name} {shape.dtype}: refined {len(report)} bucket(s) in "
              f"{time.perf_counter() - t0:.0f}s, changed: {', '.join(gained) or 'none'}; wrote "
              f"{path} (routing kept)", flush=True)
        done += 1
    return 0 if done else 2


DenseTuner = Callable[[argparse.Namespace, Path, bool], int]


def main(argv: list[str] | None = None, dense: DenseTuner | None = None) -> int:
    """`dense(args, out, force)`: the dense GEMMs' search writing its tables into out (the caller
    gives it: moe_serve.bench.experts.run.tune_dense from `moe-serve tune`); None: MoE only."""
    argv = sys.argv[1:] if argv is None else argv
    if "--for-vllm" in argv:
        from moe_serve.kernels.tuning import vllm_tune

        return vllm_tune.main([a for a in argv if a != "--for-vllm"])
    args = parse_args(argv)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interp:
        print("moe-serve tune: no CUDA GPU visible; tuning needs the GPU that will serve "
              "(set TRITON_INTERPRET=1 to run the pipeline on CPU for testing)", file=sys.stderr)
        return 2
    try:
        cfg = read_config(args.model)
        shapes = moe_shapes(cfg, args.tensor_parallel_size, args.quantization,
                            name=Path(args.model).name)
    except (ModelConfigError, OSError, json.JSONDecodeError) as e:
        print(f"moe-serve tune: {e}", file=sys.stderr)
        return 2
    if not shapes:
        print(f"moe-serve tune: {args.model} has no MoE layers (no expert count / top-k in "
              f"config.json)", file=sys.stderr)
        return 2
    device = configs.device_name()
    device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out) if args.out else configs.cache_dir(device)
    out.mkdir(parents=True, exist_ok=True)
    if args.out:               # the routing step must read the tables just written
        os.environ["MOE_SERVE_KERNEL_CONFIG_DIR"] = str(out)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    budget = args.budget_minutes * 60
    use_vllm = not args.no_vllm and device_kind == "cuda"
    warning = seed_warning(device_kind)
    if warning:
        print(warning, file=sys.stderr)
    if args.refine is not None:
        phases = [p.strip() for p in args.refine.split(",") if p.strip()]
        unknown = [p for p in phases if p not in refine.phase_names()]
        if unknown or not phases:
            print(f"moe-serve tune: --refine: unknown phase(s) {unknown or [args.refine]}; "
                  f"phases: {', '.join(refine.phase_names())}", file=sys.stderr)
            return 2
        try:
            return _refine(shapes, phases, out, device, device_kind, buckets, budget)
        finally:
            precompile.shutdown_pool()
    search_s = budget * (1 - ROUTE_SHARE if use_vllm else 1) / len(shapes)
    prog = Progress(budget)
    entries: dict[str, Any] = {}
    t_start = time.perf_counter()
    try:
        for i, shape in enumerate(shapes):
            E, N, K, topk = shape.key
            table_path = out / configs.config_file_name(E, N, K, shape.dtype, device)
            t0 = time.perf_counter()
            if table_path.is_file() and not args.force:
                print(f"[tune] {shape.name} {shape.dtype}: already tuned ({table_path}); "
                      f"--force to re-tune", file=sys.stderr)
            else:
                part = _partial_path(out, shape, device)
                state = json.loads(part.read_text()) if part.is_file() and not args.force else {}
                if state:
                    print(f"[tune] resuming {shape.name} after {state['done'][-1]}", file=sys.stderr)

                def checkpoint(st: dict[str, Any], part: Path = part, i: int = i) -> None:
                    part.parent.mkdir(parents=True, exist_ok=True)
                    part.write_text(json.dumps(st))
                    n = len(tune.PHASES) + 2
                    prog.show(f"{shape.name} {shape.dtype}: {st['done'][-1]}",
                              (i + len(st["done"]) / n) / len(shapes) * (1 - ROUTE_SHARE))

                table = tune.tune_shape(E, N, K, topk, shape.dtype, buckets, search_s,
                                        device_kind, log=lambda s: None, state=state,
                                        on_phase=checkpoint)
                tune.write_table(table, E, N, K, shape.dtype, out, device,
                                 {"model": shape.name, "search_s": round(time.perf_counter() - t0)})
                part.unlink(missing_ok=True)
            selection.clear_caches()
            deadline = t_start + budget
            ent = _route_shape(shape, device_kind, args.replays, deadline, use_vllm, max(buckets))
            entries[routing.shape_key(E, N, K, shape.dtype)] = ent
            prog.show(f"{shape.name} {shape.dtype}: routed", (i + 1) / len(shapes))
            prog.done()
            print(_summary(shape, ent, time.perf_counter() - t0), flush=True)
    except KeyboardInterrupt:
        prog.done()
        print("[tune] interrupted: finished phases are saved; run the same command to resume",
              file=sys.stderr)
        return 130
    finally:
        precompile.shutdown_pool()
    path = _write_routing(out, device, entries)
    selection.clear_caches()
    print(f"[tune] wrote {len(shapes)} table(s) and {path} in {time.perf_counter() - t_start:.0f}s",
          flush=True)
    return dense(args, out, args.force) if dense is not None and args.dense else 0


if __name__ == "__main__":
    sys.exit(main())
