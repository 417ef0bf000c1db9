"""Tune fused-MoE configs on the GPU under CUDA-graph replay and write kernels/configs/*.json.

    python -m kernels.tune --shape 8,1792,4096,2 --dtype bf16 --dtype fp8 --out kernels/configs

Per (shape, dtype), all M buckets, four phases starting from the default heuristic:
A: GEMM1 (FUSE_GU x SPLIT_K) grid at small M; B: GEMM1 tiles (BK, stages, BN, swap, BM /
warps, GROUP_M) one dimension at a time around A's winner; C: GEMM2 (SPLIT_K, BK, stages, BN,
swap); D: the winners of the adjacent M buckets. Candidates are pruned statically (tl.dot
dims >= 16, swapped BLOCK_N % 64 == 0, SPLIT_K <= K tiles, shared memory <= 227 KB), then
each phase's new variants are compiled for sm_90 in a process pool on the host CPU
(kernels.aot) so the GPU process loads them from Triton's disk cache; variants that fail or
exceed shared memory there are dropped. Compiled variants do not depend on M. A time budget
per (shape, dtype) stops the sweep and keeps the best so far.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kernels import configs
from kernels.fused_moe import FP8, Fp8Scales, fused_moe


def time_graph(fn: Callable[[int], Any], n_sets: int, replays: int = 20) -> float:
    """Median us per call: capture fn(0..n_sets-1) into one CUDA graph, replay `replays` times.
    Falls back to wall clock (no graph) on CPU."""
    if not torch.cuda.is_available():
        t = []
        for r in range(max(2, replays // 5)):
            t0 = time.perf_counter()
            for i in range(n_sets):
                fn(i)
            t.append((time.perf_counter() - t0) / n_sets * 1e6)
        return statistics.median(t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_sets):  # eager warm-up: compiles and allocator warm
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_sets):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n_sets)
    del g
    return statistics.median(times)


def make_problem(E: int, N: int, K: int, topk: int, M: int, dtype: str, n_sets: int,
                 device: str, seed: int = 0, weights: tuple | None = None) -> dict[str, Any]:
    """Random never-zero inputs, n_sets routings (softmax of random logits, top-k)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if weights is None:  # generated on the device (DeepSeek-V3 shard: 2.8 GB in bf16)
        gd = torch.Generator(device=device).manual_seed(seed)
        w1 = torch.randn(E, 2 * N, K, generator=gd, device=device).mul_(K ** -0.5)
        w2 = torch.randn(E, K, N, generator=gd, device=device).mul_(N ** -0.5)
        if dtype == "fp8":
            s1 = w1.abs().flatten(1).amax(1) / 448
            s2 = w2.abs().flatten(1).amax(1) / 448
            w1 = (w1 / s1[:, None, None]).to(FP8)
            w2 = (w2 / s2[:, None, None]).to(FP8)
            weights = (w1, w2, s1, s2)
        else:
            weights = (w1.to(torch.bfloat16), w2.to(torch.bfloat16), None, None)
        del gd
    sets = []
    for _ in range(n_sets):
        x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
        p = torch.softmax(torch.randn(M, E, generator=g), -1)
        tw, ids = p.topk(topk, -1)
        sets.append((x, tw.float().to(device), ids.to(torch.int32).to(device)))
    fp8 = None
    if dtype == "fp8":
        fp8 = Fp8Scales(weights[2], weights[3], torch.tensor(0.02, device=device),
                        torch.tensor(0.02, device=device))
    return {"weights": weights, "sets": sets, "fp8": fp8}


def time_ours(prob: dict[str, Any], cfg: dict | None, replays: int = 20) -> float:
    w1, w2 = prob["weights"][:2]
    outs = [torch.empty_like(x) for x, _, _ in prob["sets"]]

    def call(i: int) -> None:
        x, tw, ids = prob["sets"][i]
        fused_moe(x, w1, w2, tw, ids, fp8=prob["fp8"], out=outs[i], config=cfg)
    return time_graph(call, len(prob["sets"]), replays)


from kernels.smem import SMEM_LIMIT  # noqa: E402  bytes per CTA on sm_90 (227 KB)


def _k_tiles(K: int, bk: int) -> int:
    return -(-K // bk)


def _ok_tile(c: dict, n_rows: int, k_in: int) -> bool:
    """Static pruning: tl.dot dims >= 16, swapped tiles need BLOCK_N % 64 == 0 (wgmma M slot),
    BLOCK_K not above the padded reduction dim, SPLIT_K leaves >= 1 K tile per split."""
    if c["BLOCK_N"] < 16 or c["BLOCK_K"] < 16 or c["BLOCK_M"] < 16:
        return False
    if c["SWAP_AB"] and (c["BLOCK_N"] % 64 or c["BLOCK_M"] >= 64):
        return False
    if c["BLOCK_K"] > max(16, 1 << (k_in - 1).bit_length()):
        return False
    if c.get("SPLIT_K", 1) > _k_tiles(k_in, c["BLOCK_K"]):
        return False
    if c["BLOCK_N"] > max(16, 1 << (n_rows - 1).bit_length()):
        return False
    return True


def _smem_estimate(c: dict, a_bytes: int, w_bytes: int, gate_up: bool,
                   a_silu: bool = False) -> int:
    """Shared memory upper bound (kernels.smem.estimate, validated against sm_90 compiles)."""
    from kernels import smem

    return smem.estimate(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], a_bytes,
                         w_bytes, gate_up, a_silu)


def _vary(base: dict, key: str, values) -> list[dict]:
    return [{**base, key: v} for v in values if v != base.get(key)]


def gate_stage_a(base: dict, E: int, N: int, K: int, dtype: str) -> list[dict]:
    """GEMM1 phase A: (FUSE_GU x SPLIT_K) grid around the heuristic (small M only)."""
    g = {k: base[k] for k in configs.KEYS + ("SPLIT_K", "FUSE_GU")}
    if g["BLOCK_M"] >= 64:
        return [g]
    kt = _k_tiles(K, g["BLOCK_K"])
    s0 = g["SPLIT_K"]
    splits = sorted({s for s in (1, s0 // 2, s0, s0 * 2, s0 * 4) if 1 <= s <= min(kt, 16)})
    out = []
    for fgu in (True, False):
        for sk in splits:
            c = {**g, "FUSE_GU": fgu, "SPLIT_K": sk}
            if fgu and g["SWAP_AB"]:
                c["BLOCK_N"] = 64
            out.append(c)
    return out


def gate_stage_b(best: dict, K: int, dtype: str) -> list[dict]:
    """GEMM1 phase B: one dimension at a time around the phase-A winner."""
    g = {k: best[k] for k in configs.KEYS + ("SPLIT_K", "FUSE_GU")}
    fp8 = dtype == "fp8"
    out = _vary(g, "BLOCK_K", (128, 256) if fp8 else (64, 128))
    out += _vary(g, "num_stages", (3, 4, 5) if g["BLOCK_M"] <= 32 else (3, 4))
    out += _vary(g, "BLOCK_N", (64, 128) if g["SWAP_AB"] else (64, 128, 256))
    if g["BLOCK_M"] < 64:
        out += [{**g, "SWAP_AB": not g["SWAP_AB"]}]
        out += _vary(g, "BLOCK_M", (16, 32))
    else:
        out += _vary(g, "num_warps", (4, 8))
        out += _vary(g, "GROUP_M", (1, 8))
    return out


def down_candidates(best: dict, N: int, dtype: str) -> list[dict]:
    """GEMM2 (DOWN): SPLIT_K values, then BK / stages / BN / swap, around best's DOWN."""
    d = {k: v for k, v in configs.down_config(best).items() if k != "BLOCK_M"}
    small = best["BLOCK_M"] < 64
    kt = _k_tiles(N, d["BLOCK_K"])
    out = []
    if small:
        out += _vary(d, "SPLIT_K", [s for s in (1, 2, 4, 8) if s <= kt])
    out += _vary(d, "BLOCK_K", (128, 256) if dtype == "fp8" else (64, 128))
    out += _vary(d, "num_stages", (3, 4) if not small else (2, 3, 4))
    out += _vary(d, "BLOCK_N", (64, 128) if d["SWAP_AB"] else (64, 128, 256))
    if small:
        out += [{**d, "SWAP_AB": not d["SWAP_AB"]}]
    return out


def _legal(cfg: dict, N: int, K: int, dtype: str) -> bool:
    from kernels import smem

    try:
        cfg = configs.validate(cfg)
    except ValueError:
        return False
    d = configs.down_config(cfg)
    rows1 = N if cfg["FUSE_GU"] else 2 * N
    return (_ok_tile(cfg, rows1, K) and _ok_tile(d, K, N)
            and max(smem.gemm_estimates(cfg, dtype)) <= SMEM_LIMIT)


# ---- parallel ahead-of-time compiles (host CPU, sm_90) -> Triton's disk cache ------------
_POOL = None


def _compile_job(job: tuple) -> dict:
    """Worker: record one config's launches on CPU tensors and compile them for sm_90.
    Returns {variant key: shared bytes or -1 on failure}."""
    E, N, K, topk, dtype, M, cfg = job
    from kernels import aot
    from kernels.launch import record_launches

    wdt = FP8 if dtype == "fp8" else torch.bfloat16
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w1, w2 = torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt)
    tw = torch.empty(M, topk)
    ids = (torch.arange(M * topk) % E).reshape(M, topk).to(torch.int32)
    fp8 = Fp8Scales(torch.ones(E), torch.ones(E), torch.ones(()), torch.ones(())) \
        if dtype == "fp8" else None
    with record_launches() as launches:
        fused_moe(x, w1, w2, tw, ids, fp8=fp8, config=cfg)
    res = {}
    for ln in launches:
        key = _variant(ln)
        try:
            (_, ck), = aot.compile_launches([ln], cache=_WORKER_CACHE)
            res[key] = int(ck.metadata.shared)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e)[:200]}"
            if "resource" in msg.lower() or "shared mem" in msg.lower():
                res[key] = -1      # prune: cannot run on sm_90
            res["error"] = msg     # anything else: not pruned, the GPU process decides
    return res


_WORKER_CACHE: dict = {}


def _variant(launch: tuple) -> str:
    from kernels.launch import kernel_name

    kernel, _, args, kwargs = launch
    dts = ",".join(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    return f"{kernel_name(kernel)}|{sorted(kwargs.items())}|{dts}"


def _pool_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def precompile(jobs: list[tuple], workers: int | None = None, timeout_s: float = 240.0,
               log: Callable = print) -> dict[str, int]:
    """Compile the variants of jobs (E, N, K, topk, dtype, M, cfg) for sm_90 in a process pool
    on the host CPU; the GPU process then loads them from Triton's disk cache. Variants seen
    before are skipped. Best effort: on any pool failure the GPU process compiles lazily.
    Returns {variant: shared bytes (-1 failed)} for every variant compiled so far."""
    global _POOL
    from kernels.launch import record_launches

    todo, seen = [], set()
    for job in jobs:
        E, N, K, topk, dtype, M, cfg = job
        wdt = FP8 if dtype == "fp8" else torch.bfloat16
        try:
            with record_launches() as launches:
                fused_moe(torch.empty(M, K, dtype=torch.bfloat16),
                          torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt),
                          torch.empty(M, topk), torch.zeros(M, topk, dtype=torch.int32),
                          fp8=Fp8Scales(torch.ones(E), torch.ones(E), torch.ones(()),
                                        torch.ones(())) if dtype == "fp8" else None, config=cfg)
        except Exception:  # noqa: BLE001
            continue
        keys = {_variant(ln) for ln in launches}
        if keys - seen - set(_COMPILED):
            todo.append(job)
            seen |= keys
    if not todo:
        return _COMPILED
    t0 = time.perf_counter()
    try:
        import concurrent.futures as cf
        import multiprocessing as mp

        if _POOL is None:
            n = workers or max(1, min(14, (os.cpu_count() or 2) - 2))
            _POOL = cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"),
                                           initializer=_pool_init)
        futs = [_POOL.submit(_compile_job, j) for j in todo]
        done, _ = cf.wait(futs, timeout=timeout_s)
        for f in done:
            try:
                r = f.result()
            except Exception as e:  # noqa: BLE001
                log(f"    precompile job failed: {type(e).__name__}: {e}")
                continue
            if "error" in r:
                log(f"    precompile: {r.pop('error')}")
            _COMPILED.update(r)
        log(f"  [precompile] {len(todo)} configs, {len(done)}/{len(futs)} done in "
            f"{time.perf_counter() - t0:.0f}s")
    except Exception as e:  # noqa: BLE001
        log(f"  [precompile] pool unavailable ({type(e).__name__}: {e}); compiling lazily")
    return _COMPILED


_COMPILED: dict[str, int] = {}


def shutdown_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.shutdown(cancel_futures=True)
        _POOL = None


def _compiles_ok(E: int, N: int, K: int, topk: int, dtype: str, M: int, cfg: dict) -> bool:
    """False when a precompiled variant of cfg failed or exceeds shared memory."""
    from kernels.launch import record_launches

    if not _COMPILED:
        return True
    wdt = FP8 if dtype == "fp8" else torch.bfloat16
    with record_launches() as launches:
        fused_moe(torch.empty(M, K, dtype=torch.bfloat16), torch.empty(E, 2 * N, K, dtype=wdt),
                  torch.empty(E, K, N, dtype=wdt), torch.empty(M, topk),
                  torch.zeros(M, topk, dtype=torch.int32),
                  fp8=Fp8Scales(torch.ones(E), torch.ones(E), torch.ones(()), torch.ones(()))
                  if dtype == "fp8" else None, config=cfg)
    for ln in launches:
        sh = _COMPILED.get(_variant(ln))
        if sh is not None and (sh < 0 or sh > SMEM_LIMIT):
            return False
    return True


def tune_shape(E: int, N: int, K: int, topk: int, dtype: str, buckets: tuple[int, ...],
               budget_s: float, device: str = "cuda", log: Callable = print,
               parallel: bool = True) -> dict[int, dict]:
    """Per bucket: phase A (GEMM1 FUSE_GU x SPLIT_K), phase B (GEMM1 tiles, one dim at a
    time), phase C (GEMM2: SPLIT_K, tiles), phase D (the adjacent buckets' winners: one-dim
    walks can stop at a local optimum, e.g. Mixtral bf16 M=128 at 0.91x of vLLM while M=256's
    config ran M=160 at 1.10x). Candidates are pruned statically (_legal), then
    compiled for sm_90 in a host process pool before each phase (parallel=True), pruned again
    on shared memory / compile failure, then timed under CUDA-graph replay."""
    t0 = time.perf_counter()
    table: dict[int, dict] = {b: configs.default_config(b, E, N, K, topk, dtype) for b in buckets}
    best_t: dict[int, float] = {}
    weights = None
    probs: dict[int, dict] = {}

    def over() -> bool:
        return time.perf_counter() - t0 > budget_s

    def prob(b: int) -> dict:
        nonlocal weights
        if b not in probs:
            probs[b] = make_problem(E, N, K, topk, b, dtype, n_sets=4, device=device,
                                    weights=weights)
            weights = probs[b]["weights"]
        return probs[b]

    def run_phase(name: str, make: Callable[[int, dict], list[dict]]) -> None:
        cands = {}
        for b in buckets:
            cs = [configs.validate(c) for c in make(b, table[b]) if _legal(c, N, K, dtype)]
            cands[b] = [c for c in cs if c != table[b]]
        if parallel and device.startswith("cuda"):
            precompile([(E, N, K, topk, dtype, b, c) for b in buckets
                        for c in [table[b]] + cands[b]], log=log)
        for b in buckets:
            if over():
                log(f"  M={b} {name}: budget spent")
                continue
            p = prob(b)
            if b not in best_t:
                try:
                    best_t[b] = time_ours(p, table[b])
                except Exception as e:  # noqa: BLE001  the start config itself cannot run
                    log(f"    start config fails ({type(e).__name__}: {str(e)[:120]}); "
                        f"any working candidate wins")
                    best_t[b] = float("inf")
            for c in cands[b]:
                if over():
                    break
                if not _compiles_ok(E, N, K, topk, dtype, b, c):
                    continue
                try:
                    t = time_ours(p, c)
                except Exception as e:  # noqa: BLE001  OutOfResources, compile errors, ...
                    log(f"    skip {c}: {type(e).__name__}: {str(e)[:120]}")
                    if torch.cuda.is_available():
                        try:  # a failed capture must not poison the next candidate
                            torch.cuda.synchronize()
                        except Exception:  # noqa: BLE001
                            pass
                    continue
                if t < best_t[b]:
                    best_t[b], table[b] = t, c
            log(f"  M={b} {name}: {best_t[b]:.1f} us  {table[b]}  ({time.perf_counter() - t0:.0f}s)")

    def phase_a(b: int, cur: dict) -> list[dict]:
        return [{**c, "DOWN": cur["DOWN"]} for c in gate_stage_a(cur, E, N, K, dtype)]

    def phase_b(b: int, cur: dict) -> list[dict]:
        out = []
        for c in gate_stage_b(cur, K, dtype):
            out.append({**c, "DOWN": cur["DOWN"]})
        return out

    def phase_c(b: int, cur: dict) -> list[dict]:
        base = {k: cur[k] for k in configs.KEYS + ("SPLIT_K", "FUSE_GU")}
        return [{**base, "DOWN": d} for d in down_candidates(cur, N, dtype)]

    def phase_d(b: int, cur: dict) -> list[dict]:
        i = buckets.index(b)
        return [table[n] for n in buckets[max(0, i - 1):i + 2] if n != b]

    run_phase("A gate split/fuse", phase_a)
    run_phase("B gate tiles", phase_b)
    run_phase("C down", phase_c)
    run_phase("D neighbours' winners", phase_d)
    probs.clear()
    from kernels import smem

    return {b: smem.fit(configs.validate(c), dtype) for b, c in table.items()}


def write_table(table: dict[int, dict], E: int, N: int, K: int, dtype: str, out_dir: Path,
                device: str) -> Path:
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / configs.config_file_name(E, N, K, dtype, device)
    data = {str(k): v for k, v in sorted(table.items())}
    data["triton_version"] = triton.__version__
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", action="append", required=True, help="E,N,K,topk")
    ap.add_argument("--dtype", action="append", default=None, choices=["bf16", "fp8"])
    ap.add_argument("--out", default=str(configs.CONFIG_DIR))
    ap.add_argument("--buckets", default=",".join(map(str, configs.M_BUCKETS)))
    ap.add_argument("--budget-s", type=float, default=65.0, help="per shape and dtype")
    ap.add_argument("--no-parallel", action="store_true", help="no host-CPU precompile pool")
    args = ap.parse_args(argv)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    dev = configs.device_name()
    for shape in args.shape:
        E, N, K, topk = (int(v) for v in shape.split(","))
        for dtype in args.dtype or ["bf16", "fp8"]:
            print(f"[tune] E={E} N={N} K={K} topk={topk} {dtype} on {dev}", flush=True)
            table = tune_shape(E, N, K, topk, dtype, buckets, args.budget_s,
                               "cuda" if torch.cuda.is_available() else "cpu",
                               log=lambda s: print(s, flush=True), parallel=not args.no_parallel)
            print(f"[tune] wrote {write_table(table, E, N, K, dtype, Path(args.out), dev)}",
                  flush=True)
            configs.load_table.cache_clear()
            configs.get_config.cache_clear()
    shutdown_pool()
    return 0


if __name__ == "__main__":
    sys.exit(main())
