"""What every part of the expert-kernel bench shares: the device, a log, the copy ceiling, and the
problems (weights, routing, input sets) it times and checks."""
from __future__ import annotations

from typing import Any

import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def log(*a: Any) -> None:
    print(*a, flush=True)


def named(wanted: str | None, default: tuple[str, ...], known: dict[str, Any], what: str) -> dict[str, Any] | None:
    """{name: known[name]} for a comma list (default when None); None, after saying which names are
    unknown and which are known, where any is not."""
    names = wanted.split(",") if wanted else list(default)
    if unknown := [n for n in names if n not in known]:
        log(f"unknown {what} {unknown}; named: {', '.join(known)}")
        return None
    return {n: known[n] for n in names}


def copy_ceiling() -> dict[str, Any]:
    """Device copy bandwidth in bytes/s, counting bytes read + written (2 x buffer size).

    A graph-replayed same-dtype copy_ becomes a memcpy node that the driver may run on a copy
    engine (~2.7 TB/s on the H200), not on the SMs our kernels use, so three are timed on 1 GiB
    fp32 buffers after a warm-up, CUDA events around 20 back-to-back eager calls: an SM copy
    kernel (torch.mul(a, 1, out=b): one read, one write per element), the eager memcpy and
    the graph-replayed memcpy; the ceiling is the best of them, all are reported."""
    if not CUDA:
        return {"copy_bytes_per_s": float("nan")}
    from moe_serve.kernels.tuning.timing import time_graph

    n = 1 << 28                                   # 256 Mi fp32 = 1 GiB per buffer
    a = torch.rand(n, device=DEV)
    b = torch.empty_like(a)
    moved = 2 * a.numel() * a.element_size()

    def eager(fn, iters: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) * 1e3 / iters    # us per call

    res = {"sm_copy_kernel": moved / (eager(lambda: torch.mul(a, 1.0, out=b)) * 1e-6),
           "memcpy_eager": moved / (eager(lambda: b.copy_(a)) * 1e-6),
           "memcpy_graph": moved / (time_graph(lambda i: b.copy_(a), 1, replays=10) * 1e-6)}
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": max(res.values()), "buffer_bytes": moved // 2, **res}


def problem(shape: tuple, M: int, dtype: str, n_sets: int, weights: tuple | None = None) -> dict:
    """moe_serve.kernels.tuning.timing.make_problem for a (E, N, K, top-k) shape at M tokens on DEV, seeded by M."""
    from moe_serve.kernels.tuning.timing import make_problem

    E, N, K, topk = shape
    return make_problem(E, N, K, topk, M, dtype, n_sets, DEV, seed=M, weights=weights)
