"""`moe-serve explain`: which kernel serves each MoE shape of a model at each M, and why.

    moe-serve explain --model DIR [-tp N] [--quantization fp8] [--device NVIDIA_H200]
                      [--triton-version 3.6.0] [--m 1,2,4,...] [--max-num-seqs N]

Reads DIR/config.json (no weights) for the shapes one rank runs, then for each shape and M
(default: the M buckets) prints kernels.moe.selection's decision as serving makes it: ours
decode / ours aligned / vLLM, the config ours runs and its source (env dir, tuner cache,
shipped table, default rule) with any shared-memory shrink, the measured ratio behind the
route (vLLM's time / ours) and the fallback reason. Runs on a CPU (reading tables: pass the
GPU's table name with --device, and --triton-version for the Triton the server will run;
both default to this machine's) and on the GPU. Exit codes: 0 done, 2 bad model.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kernels.moe import configs, routing, selection
from kernels.moe.router_topk import max_tokens
from kernels.plugin import backend_policy
from kernels.tuning.model_shapes import ModelConfigError, MoEShape, model_parser, moe_shapes, read_config

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


def shape_lines(shape: MoEShape, ms: list[int], device: str, triton_version: str,
                unsupported: str | None) -> list[str]:
    E, N, K, topk, dt = shape.E, shape.N, shape.K, shape.topk, shape.dtype
    first = selection.choose(E, N, K, topk, dt, ms[0], device, triton_version=triton_version)
    table = first.config.detail if first.config.source != selection.DEFAULT_RULE else "none (default rule)"
    out = [f"{shape.name}: E={E} N={N} K={K} topk={topk} {dt}, {shape.layers} layers",
           f"  config table: {table}",
           f"  routing: {selection.describe(E, N, K, dt, device, topk, triton_version)} ({first.route.rule})"]
    out += [f"  refused: {why}" for why in first.config.refused]
    out.append(f"  {'M':>6}  {'path':12}  {'config':36}  {'source':38}  {'ratio':>13}  why")
    for M in ms:
        s = selection.choose(E, N, K, topk, dt, M, device, triton_version=triton_version,
                             unsupported=unsupported)
        source = s.config.source if s.config.source != selection.DEFAULT_RULE else \
            f"default: {s.config.detail}"
        ratio = "-" if s.route.ratio is None else f"{s.route.ratio:.3f}x@M={s.route.measured_m}"
        why = (s.fallback or s.route.why) + (f"; smem fit: {', '.join(s.config.shrunk)}"
                                            if s.config.shrunk else "")
        out.append(f"  {M:>6}  {s.path:12}  {s.config.label:36}  {source:38}  {ratio:>13}  {why}")
    return out


def router_line(E: int, K: int) -> str:
    """Where the gate GEMM + top-k of an [E, K] gate run (kernels/plugin/router_hook.py)."""
    limit = max_tokens(E, K)
    if limit < 1:
        return f"router: vLLM's gate GEMM + top-k at every M (an [{E}, {K}] gate is too large for our one launch)"
    return (f"router: ours (gate GEMM + top-k in one launch) at M <= {limit}, vLLM's above; only where vLLM's "
            f"MoE runner holds the gate (Qwen3-MoE style, or Mixtral's moved there; the worker log names a layer "
            f"that keeps vLLM's), "
            f"not with --no-fused-router")


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
    lines = head
    for shape in shapes:
        lines += [""] + shape_lines(shape, ms, device, triton_version, SCHEME_FALLBACKS.get(scheme))
        lines.append("  " + router_line(shape.E, shape.K))
    lines += ["", "ratio: vLLM's time / ours at the measured M nearest to M in its routing range "
              "(> 1: ours faster). Under CUDA graphs the choice for a batch size is made at capture."]
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
    except (ModelConfigError, OSError, json.JSONDecodeError, ValueError) as e:
        print(f"moe-serve explain: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
