"""The plugin's Triton JIT side: count compiles per phase with the cause of each, and a probe
kernel that tests compile for sm_90 on any host (MOE_SERVE_TEST_JIT_KERNEL=1)."""
from __future__ import annotations

import os
import threading
from typing import Any

from kernels.plugin_state import hooks, logger, report

try:  # only for the probe kernel's annotations; the plugin works without triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    tl = None

TEST_KERNEL_ENV = "MOE_SERVE_TEST_JIT_KERNEL"
_last_spec: dict[str, dict[str, Any]] = {}  # kernel name -> specialization of its last compile
_spec_stash = threading.local()


def install_jit_monitor() -> None:
    """Chain a spec-stashing hook before kernels.jit_monitor's, and listen to its events."""
    from triton import knobs

    from kernels import jit_monitor

    jit_monitor.install()
    prev = knobs.runtime.jit_post_compile_hook

    def stash_spec(**kwargs: Any) -> Any:  # runs before jit_monitor's hook: keep the full spec
        _spec_stash.compile = kwargs.get("compile") or {}
        return prev(**kwargs) if prev is not None else None

    knobs.runtime.jit_post_compile_hook = stash_spec
    jit_monitor.add_listener(_on_jit_event)
    report().data["jit_monitor"] = True
    hooks.append("triton.knobs.runtime.jit_post_compile_hook")


def spec_of(comp: dict[str, Any]) -> dict[str, Any]:
    """{param: (type, constant, attrs)} of one compile's kwargs['compile'] dict."""
    sig = comp.get("signature") or {}
    consts = {(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v
              for k, v in (comp.get("constants") or {}).items()}
    attrs_all = (comp.get("configs") or [{}])[0] or {}
    attrs = {(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v for k, v in attrs_all.items()}
    out = {}
    for i, (name, ty) in enumerate(sig.items()):
        out[name] = (ty, consts.get(i, consts.get(name)), attrs.get(i, attrs.get(name)))
    return out


def spec_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """Which parameters' specialization changed between two compiles of one kernel."""
    if old is None:
        return "first compile of this kernel in this process"
    changed = [f"{p}: {old.get(p)} -> {v}" for p, v in new.items() if old.get(p) != v]
    return "; ".join(changed) if changed else "same specialization (new options or a fresh cache)"


def _on_jit_event(kernel: str, phase: str, kind: str, info: dict[str, Any]) -> None:
    from kernels import jit_monitor

    spec = spec_of(getattr(_spec_stash, "compile", None) or {})
    cause = spec_diff(_last_spec.get(kernel), spec)
    _last_spec[kernel] = spec
    rep = report()
    rep.set_jit(jit_monitor.snapshot())
    if phase == "serving":
        logger.warning("Triton JIT %s during serving (rank %s, pid %d): kernel=%s cause: %s",
                       kind, rep.data.get("rank"), os.getpid(), kernel, cause)


def _probe_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SALT: tl.constexpr):  # noqa: ANN001
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + SALT * 0, mask=offs < n)


_probe_jf: Any = None


def compile_probe_kernel(n: int) -> None:
    """Compile (never run) a tiny kernel for sm_90 in this process: a real Triton compile the
    JIT monitor sees, on any host. SALT = pid keeps processes from sharing a disk-cache entry."""
    global _probe_jf
    try:
        import torch

        from kernels import aot

        if _probe_jf is None:
            _probe_jf = aot.jit_function(_probe_kernel)
        x = torch.zeros(64)
        with aot.fake_cuda():
            _probe_jf.warmup(x, x, n, BLOCK=64, SALT=os.getpid(), grid=(1,))
    except Exception as exc:  # noqa: BLE001
        logger.error("moe-serve plugin: probe kernel compile failed: %r", exc)
