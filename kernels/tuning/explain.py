"""`moe-serve explain`: which kernel serves each MoE shape and dense GEMM of a model at each M, and why.

    moe-serve explain --model DIR [-tp N] [--quantization fp8] [--device NVIDIA_H200]
                      [--triton-version 3.6.0] [--m 1,2,4,...] [--max-num-seqs N] [--batch-invariant]

Reads DIR/config.json (no weights) for the shapes one rank runs and their routers, builds each
shape's layer plan (kernels/plugin/layer_plan.py, the object the server's hooks look up, with
the settings of kernels/config.py from the environment) and prints it per M (default: the M
buckets): ours decode / ours aligned / vLLM, the config ours runs and its source (env dir, tuner
cache, shipped table, default rule) with any shared-memory shrink, the measured ratio behind the
route (vLLM's time / ours), the fallback reason, what ours fuses, and where our router serves;
then per dense GEMM (QKV, O, MLP, lm_head) the token counts our GEMV serves and its table.
Runs on a CPU (reading tables: pass the GPU's table name with --device, and --triton-version for
the Triton the server will run; both default to this machine's) and on the GPU. Exit codes: 0
done, 2 bad model or setting.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from moe_serve.kernels.config import PluginConfig, PluginConfigError, current
from moe_serve.kernels.dense import configs as dense_configs
from moe_serve.kernels.moe import configs, routing
from moe_serve.kernels.plugin import backend_policy, layer_plan
from moe_serve.kernels.plugin.layer_plan import LayerFacts, LayerPlan, PlanContext
from moe_serve.kernels.tuning.dense_shapes import dense_shapes
from moe_serve.kernels.tuning.model_shapes import NESTED, ModelConfigError, MoEShape, model_parser, moe_shapes, read_config

# the hook's unsupported_reason for every layer of a quantization scheme ours cannot run at all
# (none: per-tensor, per-channel/per-token and block FP8 all run on ours; test_explain pins it)
SCHEME_FALLBACKS: dict[str, str] = {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = model_parser("moe-serve explain", __doc__)
    ap.add_argument("--device", default=None,
                    help="table name of the GPU, e.g. NVIDIA_H200 (default: this machine's GPU, else cpu)")
    ap.add_argument("--triton-version", default=None, help="the Triton the server runs (default: this one)")
    ap.add_argument("--m", default=None, help="comma-separated M values (default: the M buckets)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's max_num_seqs (the FP8 backend policy depends on it)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="as a server with vLLM's VLLM_BATCH_INVARIANT set (our kernels then fail closed)")
    return ap.parse_args(argv)


def _gpu() -> tuple[str, tuple[int, int] | None]:
    """(table name, compute capability) of this machine's GPU; ('cpu', None) without one."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    return configs.device_name(), torch.cuda.get_device_capability()


def backend_line(scheme: str, arch: str, max_num_seqs: int | None) -> str:
    d = backend_policy.choose(scheme, arch, max_num_seqs)
    hook = ("ours can serve only through vLLM's TritonExperts, which vLLM's auto choice may not pick"
            if d.backend is None else "our hook serves vLLM's TritonExperts")
    return f"vLLM MoE backend: {d.label} ({scheme}, {arch}: {d.reason}); {hook}"


def router_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The routing keys of a config.json, nested text configs merged over the top level."""
    out = dict(cfg)
    for key in NESTED:
        if isinstance(cfg.get(key), dict):
            out.update(cfg[key])
    return out


def plans(cfg: dict[str, Any], shapes: list[MoEShape], ctx: PlanContext, unsupported: str | None) -> list[LayerPlan]:
    """Each shape's layer plan, its router read from config.json (moe_serve.kernels.plugin.layer_plan.config_router)."""
    keys = router_config(cfg)
    return [layer_plan.build(LayerFacts(s.E, s.N, s.K, s.topk, s.dtype, experts_unsupported=unsupported,
                                        router=layer_plan.config_router(keys, s.E, s.K, s.topk),
                                        name=s.name, layers=s.layers), ctx) for s in shapes]


def vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "none"


def dense_lines(model: str, cfg: dict[str, Any], tp: int, quantization: str | None, device: str,
                triton_version: str, config: PluginConfig) -> list[str]:
    """Per dense GEMM of a decode step (kernels/tuning/dense_shapes.py): at which token counts our
    GEMV serves it (the buckets its tuned table lists, with the setting on) and the table's source."""
    head = "dense GEMMs (a decode step, per rank)"
    try:
        shapes = dense_shapes(cfg, tp, quantization)
    except (KeyError, TypeError, ValueError) as e:        # a config.json without attention sizes
        return [f"{head}: not derived, config.json lacks {e}"]
    lines = [f"{head}: our GEMV at the token counts its table lists, vLLM's GEMM elsewhere"]
    for shape in shapes:
        fp8 = dense_configs.is_fp8(shape.fmt)
        setting = "fp8_dense_gemv" if fp8 else "dense_gemv"
        found = dense_configs.find_table(shape.N, shape.K, shape.fmt, device, triton_version=triton_version)
        ms = [m for m in dense_configs.BUCKETS if m <= dense_configs.max_m(shape.fmt)
              and found.table and dense_configs.bucket(m, shape.fmt) in found.table]
        if not getattr(config, setting):
            why = f"vLLM's at every M: {setting} is off"
        elif not ms:
            why = (f"vLLM's at every M: no table lists it for {device} (moe-serve tune --model {model})"
                   + "".join(f"; refused {r}" for r in found.refused))
        else:
            why = (f"ours at M in {{{', '.join(map(str, ms))}}} ({found.source} {found.path.name}, "
                   f"{dense_configs.label(found.table[dense_configs.bucket(ms[0], shape.fmt)])} at M = {ms[0]}), vLLM's above")
        lines.append(f"  {shape.name:<14} [{shape.N}, {shape.K}] {shape.fmt} x{shape.per_step}: {why}")
    return lines


def explain(args: argparse.Namespace) -> list[str]:
    """The report's lines; raises ModelConfigError / OSError / ValueError on a bad model."""
    cfg = read_config(args.model)
    shapes = moe_shapes(cfg, args.tensor_parallel_size, args.quantization, name=Path(args.model).name)
    gpu, capability = _gpu()
    device = args.device or gpu
    triton_version = args.triton_version or configs.running_triton_version()
    arch = backend_policy.arch_name(capability) if capability else "sm90"
    scheme = backend_policy.quant_scheme(args.quantization, args.model)
    ms = [int(m) for m in args.m.split(",")] if args.m else list(configs.M_BUCKETS)
    head = [f"moe-serve explain: {args.model} TP={args.tensor_parallel_size} on {device}"
            f"{'' if args.device or gpu != 'cpu' else ' (no GPU here: --device names the GPU tables)'}"
            f", Triton {triton_version}{'' if args.triton_version else ' (this machine)'}"
            f", arch {arch}{'' if capability else ' (assumed: the kernels are built for Hopper)'}",
            backend_line(scheme, arch, args.max_num_seqs)]
    if not shapes:
        return head + ["no MoE layers in config.json: nothing for our kernels"]
    loaded = routing.load(device, triton_version) or {}
    head.append(f"routing tables: {', '.join(loaded.get('sources', [])) or 'none'}")
    head += [f"refused: {why}" for why in loaded.get("refused", [])]
    ctx = PlanContext(current(), device, triton_version, vllm_version(), args.batch_invariant)
    head.append(f"settings: {', '.join(f'{k}={v}' for k, v in ctx.config.model_dump().items())}")
    lines = head
    for plan in plans(cfg, shapes, ctx, SCHEME_FALLBACKS.get(scheme)):
        lines += [""] + plan.lines(ms)
    lines += [""] + dense_lines(args.model, cfg, args.tensor_parallel_size, args.quantization, device, triton_version, ctx.config)
    lines += ["", "ratio: vLLM's time / ours at the measured M nearest to M in its routing range "
              "(> 1: ours faster). Under CUDA graphs the choice for a batch size is made at capture. "
              "Our router serves only where vLLM's MoE runner holds the gate (Qwen3-MoE style, or "
              "Mixtral's moved there; the worker log names a layer that keeps vLLM's)."]
    lines += triton_note(lines, triton_version, given=args.triton_version is not None)
    if capability is None and any("vLLM's config for the shape" in ln for ln in lines):
        lines.append("Aligned-path defaults come from vLLM's config lookup on this machine (no GPU: "
                     "vLLM's default config); on the GPU vLLM reads its own table for that GPU.")
    return lines


def triton_note(lines: list[str], triton_version: str, given: bool) -> list[str]:
    """Where tables were refused for another Triton than this machine's: what that means when the
    server runs elsewhere, and how to explain for that machine's Triton."""
    made = sorted({m.group(1) for ln in lines if (m := re.search(r"made under Triton (\S+), this is", ln))})
    if given or not made:
        return []
    return ["", f"Triton: the refused tables were made under Triton {', '.join(made)}; this machine has Triton "
            f"{triton_version}, and explain assumes the server runs it. On another machine (the GPU that serves), "
            f"the tables load where its Triton matches: to see what it will serve, pass its version, e.g. "
            f"--triton-version {made[-1]} (there: python -c 'import triton; print(triton.__version__)'). A server "
            f"on Triton {triton_version} needs them re-tuned on its GPU (moe-serve tune)."]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        lines = explain(args)
    except (ModelConfigError, PluginConfigError, OSError, json.JSONDecodeError, ValueError) as e:
        print(f"moe-serve explain: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
