"""Compile Triton kernels for Hopper (sm_90) without a GPU, and read their SASS.

Used by the CPU tests (real compiles -> real JIT-hook events and cache hits) and by
bench --sass/--smoke. Needs TRITON_INTERPRET unset in the process (the interpreter turns
triton.language's own jit helpers such as tl.cdiv into interpreted functions process-wide),
except for kernels that call only builtins. A fake driver answers 'cuda, sm_90' so JITFunction.warmup() runs the
whole compile pipeline (TTIR -> PTX -> cubin with the bundled ptxas) and launches nothing.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Iterator


class _FakeCudaDriver:
    """Just enough of triton's driver interface for JITFunction.run(warmup=True)."""

    def __init__(self, arch: int = 90) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda(arch: int = 90) -> Iterator[None]:
    """Route triton's active driver to a compile-only sm_<arch> target inside the block."""
    from triton.runtime import driver

    prev = getattr(driver, "_active", None)  # None when no real driver was ever created
    driver.set_active(_FakeCudaDriver(arch))
    try:
        yield
    finally:
        driver._active = prev


def jit_function(fn: Any, **jit_kwargs: Any):
    """A real (non-interpreted) JITFunction of fn's Python function, even under
    TRITON_INTERPRET=1 (fn may be a plain function or an Interpreted/JITFunction)."""
    from triton.runtime.jit import JITFunction

    py = getattr(fn, "fn", fn)
    return JITFunction(py, **jit_kwargs)


def sass(compiled: Any) -> str:
    """SASS text of a CompiledKernel: .asm['sass'] if present, else cuobjdump on the cubin."""
    asm = compiled.asm
    if "sass" in asm:
        return asm["sass"]
    tool = shutil.which("cuobjdump")
    if tool is None:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "cuobjdump")
        tool = cand if os.path.exists(cand) else None
    if tool is None:
        raise RuntimeError("no cuobjdump found (PATH or triton/backends/nvidia/bin)")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(asm["cubin"])
        path = f.name
    try:
        return subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)


def mma_kind(sass_text: str) -> str:
    """'QGMMA' (fp8 wgmma), 'HGMMA' (16-bit wgmma), 'HMMA' (mma.sync) or 'none'."""
    for ins in ("QGMMA", "HGMMA", "HMMA"):
        if ins in sass_text:
            return ins
    return "none"


def global_loads(sass_text: str) -> dict[str, int]:
    """How many global loads in the SASS move 16 bytes ("wide": LDG / LDGSTS .128) and how many
    move 2 ("narrow": LDG .U16, the sign of an access the compiler could not prove aligned)."""
    return {"wide": len(re.findall(r"\b(?:LDG|LDGSTS)\.E\S*\.128\b", sass_text)),
            "narrow": len(re.findall(r"\bLDG\.E\S*\.U16\b", sass_text))}


def compile_launches(launches: list, arch: int = 90,
                     cache: dict[str, Any] | None = None) -> list[tuple[str, Any]]:
    """Compile recorded launches (moe_serve.kernels.moe.launch.record_launches) for sm_<arch> on any host.
    `cache` keeps the JITFunctions (and their in-memory kernel caches) across calls.
    Returns [(kernel name, CompiledKernel)] in launch order."""
    from triton.runtime.jit import JITFunction

    from moe_serve.kernels.moe.launch import JIT_OPTIONS, kernel_name

    real: dict[str, Any] = {} if cache is None else cache
    out = []
    with fake_cuda(arch):
        for kernel, grid, args, kwargs in launches:
            name = kernel_name(kernel)
            if name not in real:
                if not isinstance(kernel, JITFunction):
                    raise RuntimeError("compile_launches needs TRITON_INTERPRET unset: under the "
                                       "interpreter triton.language's own jit helpers are "
                                       "interpreted too; run it in a subprocess")
                real[name] = kernel if cache is None else jit_function(
                    kernel, **JIT_OPTIONS.get(name, {}))
            out.append((name, real[name].warmup(*args, grid=grid, **kwargs)))
    return out
