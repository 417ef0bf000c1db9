"""`moe-serve bench`: the benchmarks a user runs, one subcommand each.

    moe-serve bench serve ...     moe-serve against `vllm serve` on a whole model over HTTP (bench/serve)
    moe-serve bench kernels ...   our expert kernels against vLLM's and the streaming floor (bench/experts)
    moe-serve bench step ...      what each decode-path switch saves, kernel and model level (bench/step)
    moe-serve bench tables ...    RESULTS.md's and README.md's generated tables, from bench/results/

A subcommand that needs a package the venv lacks says in one line which extra installs it
(EXTRA_OF: the `bench` extra's scipy and psutil are not in the serving venv of the README).
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("moe_serve.bench.serve.yardstick", "moe-serve against `vllm serve` on a whole model over HTTP: alternating "
                                       "fresh server processes, intervals, resumable (2-4 min per process on one "
                                       "H200; the bench extra)"),
    "kernels": ("moe_serve.bench.experts.run", "our fused-MoE kernels against vLLM's fused_experts and the streaming floor, "
                                     "per shape, format and M (1-3 min per model on one H200); --dense: our dense "
                                     "decode GEMV against cuBLAS and the floor (3-6 min per model)"),
    "step": ("moe_serve.bench.step.cli", "each fused piece of the decode step against the unfused chain it replaces (CUDA "
                               "graphs, ~1 min), then one profiled server process per switch set at c = 1: step "
                               "time, launches, the step slice by slice (under 10 min on one GPU)"),
    "tables": ("moe_serve.bench.tables", "regenerate (or --check) the tables of RESULTS.md and README.md from bench/results/ "
                               "(seconds, any machine; the bench extra)"),
}
# top-level module -> the extra of pyproject.toml that installs it
EXTRA_OF = {"scipy": "bench", "psutil": "bench", "torch": "cpu", "triton": "cpu", "vllm": "cpu"}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return ("usage: moe-serve bench {" + ",".join(COMMANDS) + "} [--help] ...\n\n"
            + "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
            + "\n\nthe bench extra: pip install -e '.[bench]' in a checkout (the README's venv: "
              ".venv/bin/pip), or pip install 'moe-serve[bench]'\n")


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """The one line that names the extra installing `exc`'s module; None for a module of no extra."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    where = "'.[cpu]' (CPU) or '.[gpu]' (NVIDIA GPU)" if extra == "cpu" else f"'.[{extra}]'"
    return (f"moe-serve bench {command}: needs {module}, which the {extra} extra installs: "
            f"pip install -e {where} in the moe-serve checkout (the README's venv: .venv/bin/pip)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"moe-serve bench: unknown command {argv[0]!r}\n\n" + usage(), end="", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    except ModuleNotFoundError as exc:   # on import, or where a subcommand first needs it (scipy)
        line = missing_extra(argv[0], exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
