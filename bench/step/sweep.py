"""`moe-serve bench step --sweep`: the fused norm + GEMV's own config per token block.

Per norm_gemv piece asked for (moe_serve.kernels.fused.norm_gemv at the model's shape) and token block M in
1, 2, 4, 8 (9..16 run two blocks of 8 with the 8-token config): the unfused chain is timed once,
then a coordinate search (moe_serve.bench.experts.dense.coordinate_search, the dense GEMV's search keys and
feasibility rules) times the fused kernel per config from CUDA graphs over input sets rotated
past the L2, each config first checked against the chain on a fresh input set (a config off by
more than kernel_level.TOLERANCE is not timed). The buckets where the best config beat the chain
by moe_serve.kernels.dense.configs.WIN_MARGIN make the fused kernel's tuned table (kind "norm_gemv"), written
to OUT/norm-gemv-tables/: copy a file into kernels/dense/configs/ to ship it; the ops run the fused
kernel only at the buckets a table lists.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.bench.step.kernel_level import TOLERANCE
from moe_serve.bench.step.pieces import n_sets, norm_gemv_shape
from moe_serve.bench.step.shapes import StepShapes
from moe_serve.kernels.dense import configs

SWEEP_MS = (1, 2, 4, 8)                # the fused kernel's token blocks (TOKEN_BLOCK = 8)
SMOKE_AXES = (("BLOCK_N", (2, 8)), ("SPLIT_K", (1, 2)))


def sweep_bucket(N: int, K: int, M: int, write_h: bool, dtype: torch.dtype, device: str, replays: int,
                 axes: tuple, rounds: int) -> dict[str, Any]:
    """One (shape, M) row: chain_us, serving_us (the config serving would run), best_us and its
    config, how many configs were timed and how many failed their check."""
    from moe_serve.bench.experts.dense import coordinate_search, feasible, prime_capture_workspace
    from moe_serve.kernels.fused import bench_cases
    from moe_serve.kernels.fused import norm_gemv as ng
    from moe_serve.kernels.tuning.timing import time_graph

    dt = ng.DTYPES[dtype]
    count = n_sets(N * K * dtype.itemsize, device)
    cuda = device == "cuda"
    chains = [bench_cases.norm_gemv(N, K, M, dtype=dtype, write_h=write_h, device=device, compile_unfused=cuda,
                                    seed=seed) for seed in range(count)]
    if cuda:
        prime_capture_workspace(ng.MAX_M * N, 2 * N)
    chain_us = time_graph(lambda i: chains[i].unfused(), count, replays)

    def case(seed: int, cfg: dict | None = None) -> Any:       # same seed, same inputs
        return bench_cases.norm_gemv(N, K, M, dtype=dtype, write_h=write_h, device=device, cfg=cfg,
                                     compile_unfused=False, seed=seed)

    expected = case(count).unfused()[0]                         # a fresh set: the checks' inputs
    timed: dict[str, dict[str, Any]] = {}                        # config label -> its row

    def measure(cfg: dict) -> float | None:
        """us of the fused kernel with cfg (None: failed its check or to run); each config once."""
        label = configs.label(cfg)
        if label in timed:
            return timed[label].get("us")
        row: dict[str, Any] = {"config": label}
        timed[label] = row
        try:
            row["err"] = rel_err(case(count, cfg).fused()[0], expected)
            if not row["err"] <= TOLERANCE:
                return None
            sets = [case(seed, cfg) for seed in range(count)]
            row["us"] = time_graph(lambda i: sets[i].fused(), count, replays)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run is a row
            row["error"] = repr(exc)[:200]
            return None
        return row["us"]

    serving = ng.serving_config(M, N, K, dtype, torch.device(device))
    serving_us = measure(serving)
    start = serving if serving_us is not None else configs.default_config(M, N, K, dt)
    best, best_us = coordinate_search(start, axes, lambda c: feasible(c, M, K, dt), measure, rounds, K, dt)
    return {"shape": f"{N}x{K}", "N": N, "K": K, "M": M, "dtype": dt, "chain_us": chain_us,
            "serving_us": serving_us, "best_us": best_us, "best": best if best_us is not None else None,
            "configs_timed": len(timed), "configs_failed": sum("us" not in r for r in timed.values()),
            "timed": list(timed.values())}


def tables(rows: list[dict[str, Any]]) -> dict[tuple[int, int, str], dict[int, dict]]:
    """{(N, K, dtype): {bucket: config}}: the buckets whose best fused config beat the chain by
    WIN_MARGIN (shapes where none did have no table)."""
    out: dict[tuple[int, int, str], dict[int, dict]] = {}
    for r in rows:
        if r["best_us"] is not None and r["best_us"] <= (1 - configs.WIN_MARGIN) * r["chain_us"]:
            out.setdefault((r["N"], r["K"], r["dtype"]), {})[configs.bucket(r["M"])] = r["best"]
    return out


def write_tables(rows: list[dict[str, Any]], out: Path, device_name: str) -> list[Path]:
    """The tables of `tables(rows)` as moe_serve.kernels.dense.configs files under out/; their paths."""
    from moe_serve.kernels.moe.configs import running_triton_version

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for (N, K, dt), best in tables(rows).items():
        path = out / configs.table_file_name(N, K, dt, device_name, configs.NORM_GEMV)
        path.write_text(configs.table_json(best, running_triton_version()))
        paths.append(path)
    return paths


def table(rows: list[dict[str, Any]]) -> str:
    """The sweep's markdown table: chain, serving config and best config per (shape, M)."""
    def us(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) else "—"

    out = ["| shape | M | chain us | fused us (serving config) | best fused us | best config | chain / best "
           "| configs timed (failed) |", "|---|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        ratio = f"{r['chain_us'] / r['best_us']:.2f}" if r["best_us"] else "—"
        best = configs.label(r["best"]) if r["best"] else "—"
        out.append(f"| {r['shape']} | {r['M']} | {us(r['chain_us'])} | {us(r['serving_us'])} | {us(r['best_us'])} "
                   f"| {best} | {ratio} | {r['configs_timed']} ({r['configs_failed']}) |")
    return "\n".join(out)


def run(s: StepShapes, pieces: tuple[str, ...], Ms: tuple[int, ...], dtype: torch.dtype, device: str,
        replays: int, out: Path, smoke: bool) -> tuple[list[dict[str, Any]], list[Path]]:
    """Sweep every norm_gemv piece asked for at the token blocks of Ms; (rows, table files)."""
    from moe_serve.bench.experts.dense import AXES
    from moe_serve.kernels.dense.gemv import device_facts

    blocks = sorted({configs.bucket(min(M, SWEEP_MS[-1])) for M in Ms})
    rows = []
    for piece in (p for p in pieces if p.startswith("norm_gemv/")):
        N, _, write_h = norm_gemv_shape(piece, s)
        for M in blocks:
            row = sweep_bucket(N, s.hidden, M, write_h, dtype, device, replays, SMOKE_AXES if smoke else AXES,
                               1)
            rows.append({"piece": piece, **row})
            print(f"[step] sweep {piece} M={M}: chain {row['chain_us']:.1f} us, best {row['best_us']} us "
                  f"({row['configs_timed']} configs)", flush=True)
    paths = write_tables(rows, out / "norm-gemv-tables", device_facts(torch.device(device))[0])
    (out / "sweep.json").write_text(json.dumps(rows, indent=1, default=str))
    return rows, paths
