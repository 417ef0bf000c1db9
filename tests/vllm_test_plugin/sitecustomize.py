"""Test-only, for processes with tests/vllm_test_plugin on their path (tests/plugin_env.py): with
MOE_SERVE_TEST_FAIL_PIN=1, one more pin on vLLM's internals, failing, from interpreter start on,
before any vLLM plugin loads: every process of the server sees a vLLM whose internals do not match."""
from __future__ import annotations

import os

if os.environ.get("MOE_SERVE_TEST_FAIL_PIN") == "1":
    from moe_serve.kernels.plugin import vllm_pins

    def _failing_pin() -> str:
        raise AssertionError("a pin forced to fail by MOE_SERVE_TEST_FAIL_PIN=1")

    vllm_pins.PINS = (*vllm_pins.PINS, _failing_pin)
