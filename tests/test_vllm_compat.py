"""kernels/plugin/vllm_pins.py's pins on this machine's vLLM (0.32; bench/check_vllm_pins.py runs the
same on the GPU host's 0.26), its patch helper, and the vLLM-CPU points the test plugin uses."""
from __future__ import annotations

import inspect

import pytest

from kernels.plugin import vllm_compat as vc
from kernels.plugin import vllm_pins


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
