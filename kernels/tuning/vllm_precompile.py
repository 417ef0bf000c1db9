"""Compile vLLM's fused-MoE kernel for candidate configs in parallel, ahead of timing.

Worker processes on the same GPU each run vLLM's fused_experts once per (config, M key) with the
config forced (override_config), so Triton's JIT compiles exactly the variants the timing
process launches (same arguments, same integer specializations) into Triton's disk cache, where
the timing process then finds them. moe_serve.kernels.tuning.precompile compiles for sm_90 on the host CPU
from launches our launcher records; vLLM's launcher picks its Swap-AB tile from the live device
and sizes its grid from its alignment op's output, so its exact launches exist only on the GPU.
A config whose compile fails for lack of resources (shared memory, registers) or with a compile
error is never timed; any other worker error leaves the config to the timing process, which
compiles it itself, as it does every config when the pool breaks.
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing as mp
import os
import time
from typing import Any, Callable

import torch

from moe_serve.kernels.tuning.timing import make_vllm_problem, vllm_runner
from moe_serve.kernels.tuning.vllm_space import Config

_STATE: dict[str, Any] = {}
GPU_SHARE = 0.5             # of the free GPU memory the workers' weights may take


def _init(shape: tuple[int, int, int, int, str]) -> None:
    """Worker: one copy of the layer's weights on the GPU, problems made per M on demand."""
    _STATE["shape"], _STATE["weights"], _STATE["probs"] = shape, None, {}


def _problem(M: int) -> dict[str, Any]:
    E, N, K, topk, fmt = _STATE["shape"]
    if M not in _STATE["probs"]:
        prob = make_vllm_problem(E, N, K, topk, M, fmt, 1, "cuda", seed=M,
                                 weights=_STATE["weights"])
        _STATE["weights"] = prob["weights"]
        _STATE["probs"][M] = prob
    return _STATE["probs"][M]


def _job(key: tuple, cfg: Config, ms: list[int]) -> tuple[tuple, str | None]:
    """Worker: vLLM's call with cfg at each M (compiling what it launches); (key, error)."""
    try:
        for M in ms:
            vllm_runner(_problem(M), cfg)(0)
        torch.cuda.synchronize()
        return key, None
    except Exception as e:  # noqa: BLE001 - the config cannot run: reported, never timed
        return key, f"{type(e).__name__}: {str(e)[:200]}"


def worker_count(weight_bytes: int) -> int:
    """Workers the host's cores and the GPU's free memory allow (each holds the weights and a
    CUDA context, about 0.6 GB)."""
    free, _ = torch.cuda.mem_get_info()
    by_mem = int(free * GPU_SHARE // (weight_bytes + (600 << 20)))
    return max(1, min(14, (os.cpu_count() or 2) - 2, by_mem))


def cannot_run(error: str) -> bool:
    """Whether a worker's error says the config itself cannot run (shared memory, registers,
    a compile error): such a config is never timed. Other errors leave it to the timing process."""
    low = error.lower()
    return any(w in low for w in ("outofresources", "out of resource", "compilationerror"))


def wait_timeout(deadline: float, now: float) -> float | None:
    """Seconds to wait for compile jobs until deadline (perf_counter s); None (no limit) for an
    infinite deadline, which a timed wait cannot take (OverflowError in the lock's acquire)."""
    return None if math.isinf(deadline) else max(0.0, deadline - now)


class Compiler:
    """A pool of GPU worker processes for one shape; compile() as vllm_search.Bench wants it.
    A broken pool hands every config to the timing process, which compiles it itself."""

    def __init__(self, shape: tuple[int, int, int, int, str], workers: int,
                 log: Callable[[str], None] = print) -> None:
        self.log = log
        self.pool: cf.ProcessPoolExecutor | None = cf.ProcessPoolExecutor(
            workers, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(shape,))
        self.errors: dict[tuple, str] = {}

    def compile(self, jobs: dict[tuple, tuple[Config, list[int]]],
                deadline: float) -> tuple[set, set]:
        """(keys compiled or left to the timing process, keys that cannot run); keys still
        compiling at the deadline are in neither."""
        if self.pool is None:
            return set(jobs), set()
        t0 = time.perf_counter()
        try:
            futs = [self.pool.submit(_job, k, cfg, ms) for k, (cfg, ms) in jobs.items()]
            done, pending = cf.wait(futs, timeout=wait_timeout(deadline, t0))
            results = [f.result() for f in done]
        except cf.process.BrokenProcessPool as e:
            self.log(f"  [compile] the worker pool broke ({e}); compiling in the timing process")
            self.close()
            return set(jobs), set()
        for f in pending:
            f.cancel()
        ok, bad = set(), set()
        for k, err in results:
            if err is not None and cannot_run(err):
                bad.add(k)
                self.errors[k] = err
            else:
                ok.add(k)
                if err is not None:
                    self.log(f"  [compile] {jobs[k][0]}: {err} (left to the timing process)")
        self.log(f"  [compile] {len(ok)} configs compiled, {len(bad)} cannot run, {len(pending)} "
                 f"left at the deadline, in {time.perf_counter() - t0:.0f}s")
        return ok, bad

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None
