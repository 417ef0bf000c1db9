"""The vLLM version and whether moe-serve's pins on its internals hold: logged at start, in /version."""

from __future__ import annotations

import logging

import httpx
import pytest
import vllm

from moe_serve.kernels.plugin import vllm_pins
from moe_serve.service.engine import check_vllm_pins


def test_pins_hold_on_this_vllm_and_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moe_serve.service.engine")
    report = check_vllm_pins()
    assert report == {"version": vllm.__version__, "checked_versions": ["0.26", "0.32", "0.33"], "pins_hold": True,
                      "failed": {}}
    assert f"vLLM {vllm.__version__}: moe-serve's pins on its internals hold (checked for vLLM 0.26, 0.32, 0.33)" \
        in caplog.text


def test_a_failing_pin_is_named_in_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def pin_moved() -> str:
        raise AssertionError("TritonExperts.apply moved")

    monkeypatch.setattr(vllm_pins, "PINS", (*vllm_pins.PINS, pin_moved))
    report = check_vllm_pins()
    assert not report["pins_hold"] and list(report["failed"]) == ["pin_moved"]
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert "do not hold" in warning.getMessage() and "pin_moved: AssertionError('TritonExperts.apply moved')" \
        in warning.getMessage()


@pytest.mark.engine
def test_the_server_logs_and_shows_its_vllm_and_pins(server, http: httpx.Client) -> None:
    pins = http.get("/version").json()["vllm_pins"]
    assert pins["version"] == vllm.__version__ and pins["pins_hold"] and pins["failed"] == {}
    assert "moe-serve's pins on its internals hold" in server.log()
    assert "Using default MoE config" not in server.log()  # the pins' config lookup stays quiet
