"""Compile fused-MoE configs for sm_90 on the host CPU in a process pool, ahead of timing.

The GPU process then loads each variant from Triton's disk cache instead of compiling it
while a CUDA graph is being timed. Compiled variants do not depend on M. Variants that fail
or exceed shared memory are remembered, so the tuner can skip configs that cannot run.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import time
from typing import Callable

import torch

from moe_serve.kernels.moe import aot, quant_format
from moe_serve.kernels.moe.fp8_scales import FP8, unit_scales
from moe_serve.kernels.moe.fused_moe import fused_moe
from moe_serve.kernels.moe.launch import kernel_name, record_launches
from moe_serve.kernels.moe.smem import SMEM_LIMIT

_POOL = None


def _compile_job(job: tuple) -> dict:
    """Worker: record one config's launches on CPU tensors and compile them for sm_90.
    Returns {variant key: shared bytes or -1 on failure}."""
    E, N, K, topk, dtype, M, cfg = job
    ids = (torch.arange(M * topk) % E).reshape(M, topk).to(torch.int32)
    with record_launches() as launches:
        _record(E, N, K, topk, dtype, M, cfg, ids)
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


def _record(E: int, N: int, K: int, topk: int, dtype: str, M: int, cfg: dict,
            ids: torch.Tensor | None = None) -> None:
    """fused_moe on empty CPU tensors of format `dtype` (a moe_serve.kernels.moe.quant_format key; bf16
    hidden states, as the tuner times them) inside the caller's record_launches()."""
    wdt = FP8 if quant_format.is_fp8(dtype) else torch.bfloat16
    fused_moe(torch.empty(M, K, dtype=torch.bfloat16), torch.empty(E, 2 * N, K, dtype=wdt),
              torch.empty(E, K, N, dtype=wdt), torch.empty(M, topk),
              ids if ids is not None else torch.zeros(M, topk, dtype=torch.int32),
              fp8=unit_scales(dtype, E, N, K, M, x_fp8=False), config=cfg)


def _variant(launch: tuple) -> str:
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
    todo, seen = [], set()
    for job in jobs:
        try:
            with record_launches() as launches:
                _record(*job)
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


def compiles_ok(E: int, N: int, K: int, topk: int, dtype: str, M: int, cfg: dict) -> bool:
    """False when a precompiled variant of cfg failed or exceeds shared memory."""
    if not _COMPILED:
        return True
    with record_launches() as launches:
        _record(E, N, K, topk, dtype, M, cfg)
    for ln in launches:
        sh = _COMPILED.get(_variant(ln))
        if sh is not None and (sh < 0 or sh > SMEM_LIMIT):
            return False
    return True
