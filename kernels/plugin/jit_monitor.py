"""Count Triton JIT compilations per kernel and phase, telling real compiles from cache loads.

Triton calls ``knobs.runtime.jit_cache_hook`` just before ``compile()`` and
``jit_post_compile_hook`` right after, for every in-memory cache miss: that includes kernels
loaded from the on-disk cache. We tell them apart with ``knobs.compilation.listener``
(``cache_hit=`` keyword, when this Triton has it) and else by wall time between the two hooks
(a disk-cache load takes milliseconds, a compile hundreds).

In interpreter mode (TRITON_INTERPRET=1) nothing is compiled and no hook fires: counts stay 0.
Compiles for sm_90 can still happen on CPU through ``moe_serve.kernels.moe.aot`` (fake CUDA driver).

Triton's hooks are process-wide, so this module is the process's one monitor.
API: install(), set_phase(phase), snapshot() -> {(kernel, phase, kind): count},
add_listener(cb(kernel, phase, kind, info)), reset(), spec_diff(old, new) for a compile's cause.
kind is 'compile' or 'cache_load'.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Callable

Listener = Callable[[str, str, str, dict[str, Any]], None]

CACHE_LOAD_MAX_S = 0.05  # fallback threshold when the compilation listener is unavailable

_lock = threading.Lock()
_counts: Counter = Counter()
_listeners: list[Listener] = []
_state = threading.local()
_phase = "warmup"
_installed = False
_prev: dict[str, Any] = {}


def set_phase(phase: str) -> None:
    """Label following compiles ('warmup' or 'serving')."""
    global _phase
    _phase = phase


def phase() -> str:
    return _phase


def snapshot() -> dict[tuple[str, str, str], int]:
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()


def add_listener(cb: Listener) -> None:
    """cb(kernel, phase, kind, info) after each event; info has 'key', 'signature',
    'constants', 'spec' (spec_of), 'repr', 'seconds' where Triton provides them."""
    _listeners.append(cb)


def remove_listener(cb: Listener) -> None:
    if cb in _listeners:
        _listeners.remove(cb)


def spec_of(comp: dict[str, Any]) -> dict[str, Any]:
    """{param: (type, constant, attrs)} of one compile's kwargs['compile'] dict."""
    def flat(d: dict) -> dict:
        return {(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v for k, v in d.items()}

    consts = flat(comp.get("constants") or {})
    attrs = flat((comp.get("configs") or [{}])[0] or {})
    return {name: (ty, consts.get(i, consts.get(name)), attrs.get(i, attrs.get(name)))
            for i, (name, ty) in enumerate((comp.get("signature") or {}).items())}


def spec_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """Which parameters' specialization changed between two compiles of one kernel."""
    if old is None:
        return "first compile of this kernel in this process"
    changed = [f"{p}: {old.get(p)} -> {v}" for p, v in new.items() if old.get(p) != v]
    return "; ".join(changed) if changed else "same specialization (new options or a fresh cache)"


def _chain(name: str, kwargs: dict[str, Any]) -> Any:
    prev = _prev.get(name)
    return prev(**kwargs) if prev is not None else None


def _pre_hook(**kwargs: Any) -> Any:
    _state.t0 = time.perf_counter()
    _state.cache_hit = None
    return _chain("jit_cache_hook", kwargs)


def _compilation_listener(**kwargs: Any) -> None:
    _state.cache_hit = bool(kwargs.get("cache_hit"))
    prev = _prev.get("listener")
    if prev is not None:
        prev(**kwargs)


def _post_hook(**kwargs: Any) -> Any:
    seconds = time.perf_counter() - getattr(_state, "t0", time.perf_counter())
    hit = getattr(_state, "cache_hit", None)
    if hit is None:
        hit = seconds < CACHE_LOAD_MAX_S
    _state.cache_hit = None
    kind = "cache_load" if hit else "compile"
    fn = kwargs.get("fn")
    kernel = getattr(fn, "name", None) or str(getattr(fn, "__name__", fn))
    comp = kwargs.get("compile") or {}
    info = {"key": kwargs.get("key"), "repr": kwargs.get("repr"), "seconds": seconds,
            "signature": comp.get("signature"), "constants": comp.get("constants"),
            "spec": spec_of(comp), "is_warmup": kwargs.get("is_manual_warmup")}
    ph = _phase
    with _lock:
        _counts[(kernel, ph, kind)] += 1
    for cb in list(_listeners):
        try:
            cb(kernel, ph, kind, info)
        except Exception:  # a broken exporter must not break kernel launches
            pass
    return _chain("jit_post_compile_hook", kwargs)


def install() -> None:
    """Install the hooks once (idempotent), chaining any hooks already set."""
    global _installed
    if _installed:
        return
    from triton import knobs

    _prev["jit_cache_hook"] = knobs.runtime.jit_cache_hook
    _prev["jit_post_compile_hook"] = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = _pre_hook
    knobs.runtime.jit_post_compile_hook = _post_hook
    if hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener"):
        _prev["listener"] = knobs.compilation.listener
        knobs.compilation.listener = _compilation_listener
    _installed = True


def uninstall() -> None:
    """Restore the previous hooks (tests)."""
    global _installed
    if not _installed:
        return
    from triton import knobs

    knobs.runtime.jit_cache_hook = _prev.pop("jit_cache_hook", None)
    knobs.runtime.jit_post_compile_hook = _prev.pop("jit_post_compile_hook", None)
    if "listener" in _prev:
        knobs.compilation.listener = _prev.pop("listener")
    _installed = False


def compiles(phase_name: str | None = None, kind: str = "compile") -> int:
    """Total events of `kind`, optionally for one phase."""
    return sum(v for (_, ph, kd), v in snapshot().items()
               if kd == kind and (phase_name is None or ph == phase_name))
