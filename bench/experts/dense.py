"""`moe-serve bench kernels --dense`: the dense GEMMs of a decode step, our GEMV (kernels/dense)
against vLLM's GEMM for the layer and the streaming floor of the bytes it reads: for bf16 weights
torch's F.linear (cuBLAS, what vLLM runs), for FP8 weights vLLM's own FP8 linear layer against
our FP8 GEMV (dense_fp8.py; the rows' cublas_us is that baseline).

    moe-serve bench kernels --dense --model DIR [-tp 8] --out OUT    a model's dense shapes at TP
    moe-serve bench kernels --dense --dense-shapes qwen3-30b-a3b/tp8 --out OUT     named (kernels/tuning/dense_shapes.py)
    moe-serve bench kernels --dense --model bench/models/qwen3-30b-a3b-fp8-block --out OUT   FP8 layers
    TRITON_INTERPRET=1 moe-serve bench kernels --dense --smoke --out OUT           CPU, tiny shapes

Per (shape, M in 1, 2, 4, 8, and 16 for FP8), in the shape's format: every config is first checked
against float64 (one weight set's product, computed on the device) into a NaN-poisoned output
(FP8: of the dequantized weights, and vLLM's layer's output against it and against ours); then
ours with the config serving would run (the tuned table's, else the heuristic's), vLLM's GEMM and
the floor (floor.py) are timed from CUDA graphs over weight sets rotated beyond L2 (moe_serve.kernels.tuning.timing);
then a coordinate search over the config's keys (two rounds, each key through its values with the
others held) finds the best config it can. Results: OUT/results.json ("dense" rows,
"dense-sweep" every config timed), OUT/dense-tables/*.json (the best config per BLOCK_M in
moe_serve.kernels.dense.configs' table format, the buckets where it beat vLLM's GEMM: copy into
kernels/dense/configs/ to ship it), and the table
printed last: us, ratios, the fraction of the copy ceiling, and a decode step's dense GEMMs summed
over the model's layers.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import triton

from moe_serve.bench.experts.dense_fp8 import Fp8Cell
from moe_serve.kernels.tuning.dense_shapes import DEFAULT_NAMED, NAMED, SMOKE, DenseShape, dense_shapes
from moe_serve.bench.experts.problem import CUDA, DEV, copy_ceiling, log, named
from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.dense import configs
from moe_serve.kernels.dense.gemv import dense_gemv, device_facts

DENSE_MS = (1, 2, 4, 8, 16)         # each shape's up to configs.max_m of its format
TOL = 8e-3                          # bf16 output rounding, relative to the product's norm
L2_BYTES = 50 * 2 ** 20
AXES: tuple[tuple[str, tuple], ...] = (   # the search's keys and values; ("warps", k vectors per thread)
    ("BLOCK_N", (1, 2, 4, 8, 16)), ("shape_k", tuple((w, r) for w in (1, 2, 4, 8) for r in (1, 2))),
    ("SPLIT_K", (1, 2, 4, 8, 16)), ("ACC_PAIRS", (True, False)), ("PREFETCH", (True, False)))
SMOKE_AXES = (("BLOCK_N", (2, 8)), ("SPLIT_K", (1, 2)))


def with_value(cfg: dict, key: str, value: Any, K: int, dtype: str = "bf16") -> dict:
    """cfg with one search key set (shape_k: num_warps and BLOCK_K = VEC x 32 x warps x r)."""
    if key != "shape_k":
        return {**cfg, key: value}
    warps, r = value
    return {**cfg, "num_warps": warps, "BLOCK_K": configs.vec(dtype) * 32 * warps * r}


def feasible(cfg: dict, M: int, K: int, dtype: str = "bf16") -> bool:
    """A config worth timing: valid; per-token accumulators and weight registers within ~64 each
    per thread (beyond, sm_90 spills; FP8: 128 fp32 weight registers, and at most 16 token x row
    accumulators: 16 tokens x 2 rows spill); no split past the K tiles; BLOCK_K not past K's power
    of two."""
    try:
        configs.validate(cfg, dtype)
    except ValueError:
        return False
    v, bm, bn = configs.vec(dtype), configs.bucket(M, dtype), cfg["BLOCK_N"]
    per_row = cfg["BLOCK_K"] // (32 * cfg["num_warps"])             # elements per thread and row
    if configs.is_fp8(dtype):
        acc = bm * bn * (4 if cfg["ACC_PAIRS"] else 1)
        regs_ok = acc <= 64 and bn * per_row <= 128 and bm * bn <= 16
    else:
        acc = bm * bn * (v // 2 if cfg["ACC_PAIRS"] else 1)
        regs_ok = acc <= 64 and bn * per_row // 2 * (2 if cfg["PREFETCH"] else 1) <= 64
    tiles = -(-K // cfg["BLOCK_K"])
    return regs_ok and cfg["SPLIT_K"] <= tiles and cfg["BLOCK_K"] <= max(v * 32, triton.next_power_of_2(K))


def coordinate_search(start: dict, axes: tuple, ok: Callable[[dict], bool], measure: Callable[[dict], float | None],
                      rounds: int = 2, K: int = 0, dtype: str = "bf16") -> tuple[dict, float | None]:
    """The best config found from `start`: per round, each key through its values (the others at
    the best so far), keeping what measure (us, None: failed) says is faster."""
    best, best_us = start, measure(start)
    for _ in range(rounds):
        for key, values in axes:
            for value in values:
                cand = with_value(best, key, value, K, dtype)
                if cand == best or not ok(cand):
                    continue
                us = measure(cand)
                if us is not None and (best_us is None or us < best_us):
                    best, best_us = cand, us
    return best, best_us


def prime_capture_workspace(n_floats: int, n_counters: int) -> None:
    """Size the split-K workspace of the stream CUDA graphs are captured on (one per stream,
    moe_serve.kernels.moe.moe_decode_launch.split_workspace) before timing: allocated inside a capture, its
    zero fill would be a node of that graph and add a memset to one config's time. A throwaway
    graph allocates it and one replay zeroes it."""
    from moe_serve.kernels.moe.moe_decode_launch import split_workspace

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        split_workspace(torch.device(DEV), n_floats, n_counters)
    g.replay()
    torch.cuda.synchronize()


class Cell:
    """One (shape, M): n_sets weight sets and inputs on DEV, the float64 reference of set 0, and
    the timings of configs."""

    def __init__(self, shape: DenseShape, M: int, n_sets: int, replays: int, seed: int) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        N, K = shape.N, shape.K
        self.shape, self.M, self.replays = shape, M, replays
        self.n_sets = max(2, min(n_sets, -(-2 * L2_BYTES // shape.weight_bytes) + 1)) if CUDA else 2
        self.ws = [(torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(torch.bfloat16)
                   for _ in range(self.n_sets)]
        self.xs = [torch.randn(M, K, generator=g, device=DEV).to(torch.bfloat16) for _ in range(self.n_sets)]
        self.outs = [torch.empty(M, N, dtype=torch.bfloat16, device=DEV) for _ in range(self.n_sets)]
        self.ref = self.xs[0].double() @ self.ws[0].double().T
        self.tried: dict[str, float | str] = {}
        if CUDA:
            prime_capture_workspace(M * N, N)

    def check(self, cfg: dict) -> float:
        """rel_err of a config on set 0, written into a NaN-poisoned output (NaN anywhere: inf)."""
        out = torch.full_like(self.outs[0], float("nan"))
        dense_gemv(self.xs[0], self.ws[0], cfg=cfg, out=out)
        return float("inf") if out.isnan().any() else rel_err(out, self.ref)

    def time_ours(self, cfg: dict) -> float | None:
        """Median us of our GEMV with cfg, after its check (memoized); None if it fails."""
        from moe_serve.kernels.tuning.timing import time_graph

        label = configs.label(cfg)
        if label in self.tried:                       # measured before (the search revisits)
            res = self.tried[label]
            return res if isinstance(res, float) else None
        try:
            err = self.check(cfg)
            if not err < TOL:
                self.tried[label] = f"check failed: rel_err {err:.2e}"
                return None
            us = time_graph(lambda i: dense_gemv(self.xs[i], self.ws[i], cfg=cfg, out=self.outs[i]),
                            self.n_sets, self.replays)
        except Exception as e:  # noqa: BLE001 - one config must not stop the search
            self.tried[label] = f"{type(e).__name__}: {e}"[:200]
            return None
        self.tried[label] = us
        return us

    def time_cublas(self) -> float:
        from moe_serve.kernels.tuning.timing import time_graph

        assert rel_err(torch.nn.functional.linear(self.xs[0], self.ws[0]), self.ref) < TOL
        return time_graph(lambda i: torch.nn.functional.linear(self.xs[i], self.ws[i]), self.n_sets, self.replays)


def baseline(cell: Cell | Fp8Cell, serving: dict) -> dict[str, float]:
    """vLLM's GEMM of a cell: F.linear timed on CUDA (bf16); for FP8 vLLM's layer checked
    (against float64 and ours with the serving config: Fp8Cell.check_vllm) wherever vLLM builds
    it, timed on CUDA. The time is the row's cublas_us."""
    if isinstance(cell, Cell):
        return {"cublas_us": cell.time_cublas()} if CUDA else {}
    if not cell.vllm:
        return {}
    out = {"err_vs_vllm": cell.check_vllm(serving), "vllm_err": cell.vllm_err}
    return {**out, "cublas_us": cell.time_vllm()} if CUDA else out


def part_dense(shapes: dict[str, list[DenseShape]], ms: tuple[int, ...], ceiling: float, n_sets: int,
               replays: int, sweep: bool, axes: tuple = AXES, rounds: int = 2,
               sweep_rows: list | None = None,
               on_shape: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One row per (model, shape, M <= configs.max_m of its format): ours (serving's config), vLLM's
    GEMM (baseline), the floor, the best config the search found; every config tried goes to
    sweep_rows; on_shape(rows so far) after each shape, so a run stopped midway keeps what it did."""
    from moe_serve.bench.experts.floor import floor_us

    device, sms = device_facts(torch.device(DEV))
    rows: list[dict] = []
    floors: dict[int, float] = {}
    for model, group in shapes.items():
        for shape in group:
            fmt = shape.fmt
            for M in (m for m in ms if m <= configs.max_m(fmt)):
                row: dict[str, Any] = dict(model=model, shape=shape.name, N=shape.N, K=shape.K, M=M,
                                           per_step=shape.per_step, mbytes=shape.weight_bytes / 1e6,
                                           **({"fmt": fmt} if fmt != "bf16" else {}))
                serving = configs.config_for(M, shape.N, shape.K, fmt, device, sms)
                row["cfg"] = configs.label(serving)
                row["tuned"] = configs.load_table(shape.N, shape.K, fmt, device) is not None
                try:
                    cell = (Fp8Cell(shape.N, shape.K, fmt, M, n_sets, replays, seed=M) if configs.is_fp8(fmt)
                            else Cell(shape, M, n_sets, replays, seed=M))
                    row["ours_us"] = cell.time_ours(serving)
                    if row["ours_us"] is None:
                        raise RuntimeError(cell.tried[row["cfg"]])
                    row["ours_frac"] = shape.weight_bytes / (row["ours_us"] * 1e-6) / ceiling
                    row.update(baseline(cell, serving))
                    if CUDA:
                        if "cublas_us" in row:
                            row["speedup"] = row["cublas_us"] / row["ours_us"]
                            row["cublas_frac"] = shape.weight_bytes / (row["cublas_us"] * 1e-6) / ceiling
                        key = round(shape.weight_bytes, -5)
                        if key not in floors:
                            floors[key] = floor_us(shape.weight_bytes, replays)["floor_us"]
                        row["floor_us"] = floors[key]
                        row["floor_frac"] = shape.weight_bytes / (row["floor_us"] * 1e-6) / ceiling
                    if sweep:
                        ok = lambda c, M=M, K=shape.K, fmt=fmt: feasible(c, M, K, fmt)  # noqa: E731
                        best, best_us = coordinate_search(serving, axes, ok, cell.time_ours, rounds, K=shape.K,
                                                          dtype=fmt)
                        if best_us is not None:
                            row.update(best_cfg=configs.label(best), best=best, best_us=best_us,
                                       best_frac=shape.weight_bytes / (best_us * 1e-6) / ceiling)
                    for label, res in cell.tried.items():
                        if sweep_rows is not None:
                            sweep_rows.append(dict(model=model, shape=shape.name, N=shape.N, K=shape.K, M=M,
                                                   fmt=fmt, cfg=label, **({"us": res} if isinstance(res, float) else {"error": res})))
                    del cell
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                log("[dense] " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in row.items() if k != "best"))
            if CUDA:
                torch.cuda.empty_cache()
            if on_shape is not None:
                on_shape(rows)
    return rows


def write_tables(rows: list[dict], out: Path, device: str) -> list[Path]:
    """The best config per (N, K, format) and BLOCK_M as moe_serve.kernels.dense.configs tables in out: only
    the buckets where it beat vLLM's GEMM by configs.WIN_MARGIN (serving runs vLLM's at the others;
    on the CPU, where vLLM's is not timed, every bucket); a shape with no such bucket gets no table."""
    best: dict[tuple[int, int, str], dict[int, dict]] = {}
    for r in rows:
        if "best" in r and ("cublas_us" not in r or r["best_us"] <= (1 - configs.WIN_MARGIN) * r["cublas_us"]):
            fmt = r.get("fmt", "bf16")
            best.setdefault((r["N"], r["K"], fmt), {})[configs.bucket(r["M"], fmt)] = r["best"]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for (N, K, fmt), table in sorted(best.items()):
        path = out / configs.table_file_name(N, K, fmt, device)
        path.write_text(configs.table_json(table, triton.__version__))
        paths.append(path)
    return paths


def table(rows: list[dict]) -> list[str]:
    """The printed table: per row us, ratios and fractions of the copy ceiling; then per model and
    M a decode step's dense GEMMs (us x per_step, summed)."""
    f = lambda v, p=1: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    base = "vLLM" if any("fmt" in r for r in rows) else "cuBLAS"    # FP8 rows: vLLM's FP8 linear
    out = [f"| model | shape | N x K | M | ours us | {base} us | floor us | {base} / ours | ours % ceil | "
           f"{base} % ceil | floor % ceil | best us (config) | best % ceil |", "|---|---|---|---:|" + "---:|" * 9]
    step: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        pct = lambda k: f(r[k] * 100, 0) if k in r else "—"  # noqa: E731
        shape = r["shape"] + (f" ({r['fmt']})" if "fmt" in r else "")
        out.append(f"| {r['model']} | {shape} | {r['N']} x {r['K']} | {r['M']} | {f(r.get('ours_us'))} | "
                   f"{f(r.get('cublas_us'))} | {f(r.get('floor_us'))} | {f(r.get('speedup'), 2)} | {pct('ours_frac')} | "
                   f"{pct('cublas_frac')} | {pct('floor_frac')} | {f(r.get('best_us'))} ({r.get('best_cfg', '—')}) | "
                   f"{pct('best_frac')} |" + (f" ERROR {r['error']}" if "error" in r else ""))
        s = step.setdefault((r["model"], r["M"]), dict.fromkeys(("ours_us", "best_us", "cublas_us", "floor_us"), 0.0))
        for k in s:                                   # a sum with a missing term is unknown
            s[k] = None if s[k] is None or r.get(k) is None else s[k] + r[k] * r["per_step"]
    out += ["", f"| model | M | a step's dense GEMMs: ours us | best us | {base} us | floor us |",
            "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {m} | {M} | {f(s.get('ours_us'))} | {f(s.get('best_us'))} | {f(s.get('cublas_us'))} | "
            f"{f(s.get('floor_us'))} |" for (m, M), s in step.items()]
    return out


def main(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> int:
    """The --dense part: its rows into results (saved by `save` after each part), tables, print."""
    ms, axes, rounds = DENSE_MS, AXES, 2
    if args.smoke:
        shapes, ms, axes, rounds = SMOKE, (1, 4), SMOKE_AXES, 1
    elif args.model:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        shapes = {f"{Path(args.model).name}/tp{args.tensor_parallel_size}":
                  dense_shapes(cfg, args.tensor_parallel_size, args.quantization)}
    elif (shapes := named(args.dense_shapes, DEFAULT_NAMED, NAMED, "dense shapes")) is None:
        return 2
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else ms
    if not CUDA:            # the interpreter: a check of the pipeline, whose timings mean nothing
        axes, rounds = SMOKE_AXES, 1
    t0 = time.perf_counter()
    results["ceiling"] = copy_ceiling()
    ceiling = results["ceiling"]["copy_bytes_per_s"]
    sweep_rows: list[dict] = []
    device = device_facts(torch.device(DEV))[0]
    written: list[Path] = []

    def keep(rows: list[dict]) -> None:   # after each shape: the results and the tables so far
        results["dense"], results["dense-sweep"] = rows, sweep_rows
        save()
        written[:] = write_tables(rows, args.out / "dense-tables", device) if args.sweep else []

    rows = part_dense(shapes, ms, ceiling, args.sets, args.replays, args.sweep, axes, rounds, sweep_rows, keep)
    log("\n".join(table(rows)))
    log(f"dense part: {time.perf_counter() - t0:.0f}s; tables of the best configs: "
        f"{', '.join(p.name for p in written) or 'none'} in {args.out / 'dense-tables'}")
    return 1 if any("error" in r for r in rows) else 0
