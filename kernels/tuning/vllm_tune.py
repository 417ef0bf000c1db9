"""`moe-serve tune --for-vllm`: tune vLLM's own fused-MoE Triton kernel for a model's MoE shapes
on this GPU, for plain `vllm serve`.

    moe-serve tune --for-vllm --model DIR --out DIR [--tensor-parallel-size N]
                   [--quantization fp8|compressed-tensors] [--budget-minutes M] [--force]
    VLLM_TUNED_CONFIG_FOLDER=DIR vllm serve DIR ...

Reads DIR/config.json (no weights) for the shapes one rank runs and their format (bf16 / fp16,
per-tensor FP8 W8A8, block FP8), searches vLLM's kernel configs for every M key vLLM's own tuner
writes (1 .. 4096; moe_serve.kernels.tuning.vllm_search: vLLM's search space, every table vLLM ships for the
same E and N, its default) within the budget, each candidate's output checked against vLLM's
baseline before it can win, and writes each table under vLLM's own file name and format
(`E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json`, M keys as strings, triton_version) into
--out, which vLLM reads first when VLLM_TUNED_CONFIG_FOLDER names it. Beside each table a
`<table>.provenance.json` records the GPU, the vLLM / Triton / torch versions, and per M the best
time against the baseline's (what vLLM runs without the table: its shipped table for this GPU,
else its default). A table already in --out is kept unless --force.
Exit codes: 0 done, 2 no GPU / no vLLM / bad model / no --out, 3 vLLM's baseline disagrees
with float64. The CPU tests run the pipeline through tune_shape with a stand-in for vLLM's CUDA
ops around its kernel (TRITON_INTERPRET=1, wall-clock timing).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moe_serve.kernels.moe import quant_format, vllm_kernels
from moe_serve.kernels.tuning import vllm_precompile, vllm_search, vllm_space as space
from moe_serve.kernels.tuning.model_shapes import ModelConfigError, MoEShape, model_parser, moe_shapes, read_config
from moe_serve.kernels.tuning.vllm_bench import BaselineMismatch, VllmBench
from moe_serve.kernels.tuning.vllm_space import Config

FORMATS = ("bf16", "fp16", quant_format.FP8)   # and every block FP8 key


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = model_parser("moe-serve tune --for-vllm", __doc__)
    ap.add_argument("--out", required=True, help="folder for vLLM's tables (VLLM_TUNED_CONFIG_FOLDER)")
    ap.add_argument("--budget-minutes", type=float, default=2.0, help="per shape (default 2)")
    ap.add_argument("--ms", default=",".join(map(str, space.TUNER_MS)),
                    help="M keys to write (default: vLLM's tuner's, 1..4096)")
    ap.add_argument("--force", action="store_true", help="re-tune tables already in --out")
    ap.add_argument("--workers", type=int, default=None, help="compile processes (default: by "
                    "cores and GPU memory; 0: compile in the timing process)")
    return ap.parse_args(argv)


def servable(fmt: str) -> bool:
    """Formats vLLM's Triton MoE kernel serves with the configs tuned here."""
    return fmt in FORMATS or quant_format.block_shape(fmt) is not None


def seeds(E: int, N: int, K: int, topk: int, fmt: str, ms: tuple[int, ...],
          folder: Path | None = None) -> tuple[dict[int, list[tuple[Config, str]]], list[str]]:
    """Per M key: every shipped table's configs for E and N (this format's tables first; at keys
    above DECODE_MAX_M each table's two nearest entries), then vLLM's defaults at the neighbour
    keys, legal and unique, with where each came from; and the shipped tables' names."""
    same, other = space.shipped_tables(E, N, fmt, folder)
    out: dict[int, list[tuple[Config, str]]] = {}
    for i, M in enumerate(ms):
        cands: list[tuple[Config, str]] = []
        for name, table in {**same, **other}.items():
            near = sorted(table, key=lambda k: abs(k - M))
            cands += [(table[k], f"shipped:{name}")
                      for k in (near if M <= space.DECODE_MAX_M else near[:2])]
        cands += [(space.default_config(n, E, N, K, topk, fmt), f"vLLM default at M={n}")
                  for n in ms[max(0, i - 1):i + 2] if n != M]
        kept: list[tuple[Config, str]] = []
        for cfg, src in cands:
            cfg = space.effective(cfg, fmt)
            if space.legal(cfg, fmt, N, K) and all(cfg != c for c, _ in kept):
                kept.append((cfg, src))
        out[M] = kept
    return out, sorted(same) + sorted(other)


def versions() -> dict[str, Any]:
    import triton

    try:
        import vllm
        vv = vllm.__version__
    except ImportError:
        vv = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "vllm": vv, "triton": triton.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda}


def write(out: Path, name: str, results: dict[int, dict[str, Any]], meta: dict[str, Any]) -> Path:
    """vLLM's table (M keys as strings, triton_version as its tuner writes it) and beside it
    `<name minus .json>.provenance.json`."""
    import triton

    table = {"triton_version": triton.__version__,
             **{str(M): r["config"] for M, r in sorted(results.items())}}
    path = out / name
    path.write_text(json.dumps(table, indent=4) + "\n")
    per_m = {str(M): {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()}
             for M, r in sorted(results.items())}
    record = {**meta, "table": name, "table_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
              **versions(), "per_m": per_m}
    (out / (name[:-len(".json")] + ".provenance.json")).write_text(json.dumps(record, indent=1) + "\n")
    return path


def tune_shape(shape: MoEShape, out: Path, ms: tuple[int, ...], budget_s: float, device: str,
               workers: int | None, log: Callable[[str], None], experts: Callable | None = None,
               clock: Callable[[], float] = time.perf_counter) -> Path:
    """Search, check and write one shape's table (see the module doc); returns its path.
    experts and clock stand in for vLLM's fused_experts and the wall clock in the CPU tests."""
    E, N, K, topk = shape.key
    name = space.file_name(E, N, shape.dtype)
    seed_map, shipped = seeds(E, N, K, topk, shape.dtype, ms)
    compiler = None
    if device == "cuda" and workers != 0:
        wbytes = 3 * E * N * K * (1 if quant_format.is_fp8(shape.dtype) else 2)
        compiler = vllm_precompile.Compiler((E, N, K, topk, shape.dtype),
                                            workers or vllm_precompile.worker_count(wbytes), log)
    bench = VllmBench(E, N, K, topk, shape.dtype, device, experts=experts, compiler=compiler)
    t0 = time.perf_counter()
    try:
        search = vllm_search.Search(bench, ms, E, N, K, topk, shape.dtype, seed_map, budget_s,
                                    clock=clock, log=log)
        results = search.run()
    finally:
        if compiler is not None:
            compiler.close()
    meta = {"tool": "moe-serve tune --for-vllm", "model": shape.name,
            "shape": {"E": E, "N": N, "K": K, "topk": topk, "format": shape.dtype},
            "budget_s": budget_s, "seconds": round(time.perf_counter() - t0, 1),
            "shipped_tables": shipped, "search_space": len(search.space),
            "compiled": len(search.compiled), "compile_failed": len(search.compile_failed),
            "baseline": "what vLLM runs without this table (its shipped table for this GPU "
                        "where one exists, else get_default_config)"}
    return write(out, name, results, meta)


def _summary(path: Path) -> str:
    rec = json.loads(path.with_name(path.name[:-5] + ".provenance.json").read_text())
    at = ", ".join(f"M={m} {rec['per_m'][m]['speedup']:.2f}x" for m in ("1", "8", "64", "256")
                   if m in rec["per_m"])
    return f"[tune --for-vllm] wrote {path} in {rec['seconds']:.0f}s; vs vLLM's baseline: {at}"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("moe-serve tune --for-vllm: no CUDA GPU visible; tune on the GPU `vllm serve` runs on")
        return 2
    if vllm_kernels.fused_experts() is None:
        log("moe-serve tune --for-vllm: vLLM is not importable here; install the vLLM that serves")
        return 2
    try:
        shapes = moe_shapes(read_config(args.model), args.tensor_parallel_size, args.quantization,
                            name=Path(args.model).name)
    except (ModelConfigError, OSError, json.JSONDecodeError) as e:
        log(f"moe-serve tune --for-vllm: {e}")
        return 2
    shapes = [s for s in shapes if servable(s.dtype)]
    if not shapes:
        log(f"moe-serve tune --for-vllm: {args.model}: no MoE layer vLLM's Triton kernel serves "
            f"with these tables (bf16, fp16, per-tensor or block FP8)")
        return 2
    if os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None) is not None:
        log("moe-serve tune --for-vllm: ignoring VLLM_TUNED_CONFIG_FOLDER: the baseline is what "
            "vLLM runs without a tuned folder")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ms = tuple(int(m) for m in args.ms.split(","))
    for shape in shapes:
        name = space.file_name(shape.E, shape.N, shape.dtype)
        if (out / name).is_file() and not args.force:
            log(f"[tune --for-vllm] {out / name} exists; --force to re-tune")
            continue
        log(f"[tune --for-vllm] {shape.name} E={shape.E} N={shape.N} K={shape.K} "
            f"topk={shape.topk} {shape.dtype}: {len(ms)} M keys, {args.budget_minutes} min")
        try:
            path = tune_shape(shape, out, ms, args.budget_minutes * 60, "cuda", args.workers, log)
        except BaselineMismatch as e:
            log(f"moe-serve tune --for-vllm: {e}")
            return 3
        print(_summary(path), flush=True)
    print(f"[tune --for-vllm] serve with: VLLM_TUNED_CONFIG_FOLDER={out.resolve()} vllm serve ...",
          flush=True)
    return 0
