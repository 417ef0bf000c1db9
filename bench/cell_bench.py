"""The command line of the per-cell kernel benchmarks (bench_gemv.py, bench_prefetch.py): --out,
--cells "shape:format;...", --ms; a GPU required; run_cell(name, format, ms, rows, out) per cell."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RunCell = Callable[[str, str, tuple[int, ...], list, Path], None]


def main(doc: str, tag: str, cells: tuple[str, ...], ms: str, run_cell: RunCell,
         result_name: str) -> int:
    """Parse the arguments, run every cell into one rows list; 2 without a CUDA GPU."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", default=";".join(cells),
                    help="shape:format;... (bench shape names, kernels.moe.quant_format keys)")
    ap.add_argument("--ms", default=ms)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_{tag} needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for cell in args.cells.split(";"):
        name, fmt = cell.split(":", 1)
        run_cell(name, fmt, tuple(int(m) for m in args.ms.split(",")), rows, out)
    print(f"[{tag}] {len(rows)} rows in {time.perf_counter() - t0:.0f}s -> {out / result_name}",
          flush=True)
    return 0
