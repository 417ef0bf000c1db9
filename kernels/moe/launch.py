"""Kernel launch indirection: launch normally, or record launches (no execution) so the
exact same arguments can be compiled ahead of time (moe_serve.kernels.moe.aot) or counted (warmup)."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator

import triton

from moe_serve.kernels.config import current, env_name

JIT_OPTIONS: dict[str, dict[str, Any]] = {}  # kernel name -> triton.jit keyword options
_recorder: list[tuple[Any, tuple, tuple, dict]] | None = None


def jit(**options: Any) -> Callable:
    """triton.jit(**options), remembering the options so aot can rebuild a real JITFunction."""
    def deco(fn: Callable) -> Any:
        JIT_OPTIONS[fn.__name__] = options
        return triton.jit(**options)(fn)
    return deco


@functools.cache
def pdl_supported() -> bool:
    """Whether kernels may be programmatic dependent launches (griddepcontrol, sm_90+): on a
    Hopper or newer GPU, and where no CUDA device is visible (ahead-of-time compiles target
    sm_90); never under TRITON_INTERPRET, which has no inline PTX."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    import torch

    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability()[0] >= 9


BLOCK_PDL_ENV = env_name("block_pdl")


def block_pdl() -> bool:
    """Whether PDL chains the whole MoE block at decode (the block_pdl setting, kernels/config.py:
    env MOE_SERVE_BLOCK_PDL=1; where pdl_supported): our router and the decode path's up kernel
    become programmatic dependent launches too, not only the down kernel. Off unless the
    whole-model A/B shows it faster (`moe-serve bench serve`, variant moe-serve-block-pdl). In a
    worker an attribute of the config built at its start (a bad value stopped the start)."""
    return current().block_pdl and pdl_supported()


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    if _recorder is not None:
        _recorder.append((kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def record_launches() -> Iterator[list[tuple[Any, tuple, tuple, dict]]]:
    """Inside the block launches are recorded as (kernel, grid, args, kwargs), not run."""
    global _recorder
    prev, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = prev


def kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", str(fn))
