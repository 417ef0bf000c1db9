"""`moe-serve bench`: the benchmarks a user runs, one subcommand each.

    moe-serve bench serve ...     moe-serve against `vllm serve` on a whole model over HTTP (bench/serve)
    moe-serve bench kernels ...   our expert kernels against vLLM's and the streaming floor (bench/experts)
    moe-serve bench tables ...    RESULTS.md's and README.md's generated tables, from bench/results/
"""
from __future__ import annotations

import sys

COMMANDS = {
    "serve": ("bench.serve.yardstick", "moe-serve against `vllm serve` on a whole model over HTTP: alternating "
                                       "fresh server processes, intervals, resumable (2-4 min per process on one H200)"),
    "kernels": ("bench.experts.run", "our fused-MoE kernels against vLLM's fused_experts and the streaming floor, "
                                     "per shape, format and M (1-3 min per model on one H200); --dense: our dense "
                                     "decode GEMV against cuBLAS and the floor (3-6 min per model)"),
    "tables": ("bench.tables", "regenerate (or --check) the tables of RESULTS.md and README.md from bench/results/ "
                               "(seconds, any machine)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return ("usage: moe-serve bench {" + ",".join(COMMANDS) + "} [--help] ...\n\n"
            + "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"moe-serve bench: unknown command {argv[0]!r}\n\n" + usage(), end="", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
