"""The MoE backend policy table: one test per row, the user override, stock mode, scheme detection."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.kernels.plugin import backend_policy as bp

HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize("scheme,cap,seqs,backend", [
    ("fp8_per_tensor", HOPPER, 64, "triton"),
    ("fp8_per_tensor", HOPPER, None, "triton"),                       # vLLM's default batch size
    ("fp8_per_tensor", HOPPER, bp.LARGE_BATCH_SEQS, "triton"),
    ("fp8_per_tensor", HOPPER, bp.LARGE_BATCH_SEQS + 1, None),        # large batches: vLLM's choice
    ("fp8_per_channel", HOPPER, 64, "triton"),
    ("fp8_block", HOPPER, 64, None),
    ("none", HOPPER, 64, "triton"),
    ("fp8_per_tensor", AMPERE, 64, None),
    ("none", None, 64, None),                                         # CPU
    ("other", HOPPER, 64, None),
])
def test_rows(scheme, cap, seqs, backend) -> None:
    d = bp.choose(scheme, bp.arch_name(cap), seqs)
    assert (d.backend, d.source) == (backend, "policy")
    assert d.label == (backend or "auto")


def test_every_row_is_reachable() -> None:
    cases = [("fp8_per_tensor", "sm90", 8), ("fp8_per_tensor", "sm90", bp.LARGE_BATCH_SEQS + 1),
             ("fp8_per_channel", "sm90", 8), ("fp8_block", "sm90", 8), ("none", "sm90", 8), ("none", "cpu", 8)]
    hit = {bp.choose(*c).reason for c in cases}
    assert hit == {row.why for row in bp.TABLE}


def test_user_override_wins_and_stock_mode_applies_nothing() -> None:
    d = bp.choose("fp8_per_tensor", "sm90", 8, user_backend="flashinfer_cutlass")
    assert (d.backend, d.source) == ("flashinfer_cutlass", "user")
    d = bp.choose("fp8_per_tensor", "sm90", 8, mode="vllm")
    assert (d.backend, d.source) == (None, "stock")
    kwargs = {"moe_backend": "cutlass", "quantization": "fp8"}
    assert bp.decide(kwargs, "optimized", None, capability=HOPPER).backend == "cutlass"


def test_apply_sets_engine_kwargs_only_when_policy_picks(caplog, monkeypatch) -> None:
    caplog.set_level("INFO")
    monkeypatch.setattr(bp, "device_capability", lambda: HOPPER)  # no GPU here
    kw = {"quantization": "fp8", "max_num_seqs": 64}
    d = bp.apply(kw, "optimized", None)
    assert kw["moe_backend"] == "triton" and d.source == "policy"
    assert "MoE backend: triton (source=policy, scheme=fp8_per_tensor, arch=sm90)" in caplog.text
    kw2 = {"quantization": "fp8"}
    bp.apply(kw2, "vllm", None)
    assert "moe_backend" not in kw2


def test_device_capability_is_none_on_cpu() -> None:
    assert bp.device_capability() is None
    assert bp.decide({}, "optimized", None).arch == "cpu"


def _model(tmp_path: Path, qcfg: dict | None) -> str:
    cfg = {"model_type": "mixtral"}
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("flag,qcfg,scheme", [
    (None, None, "none"),
    ("fp8", None, "fp8_per_tensor"),                                   # online fp8 of a bf16 checkpoint
    (None, {"quant_method": "fp8", "activation_scheme": "static"}, "fp8_per_tensor"),
    (None, {"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8_block"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "channel"}}}}, "fp8_per_channel"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "tensor"}}}}, "fp8_per_tensor"),
    (None, {"quant_method": "awq"}, "other"),
])
def test_quant_scheme(tmp_path: Path, flag, qcfg, scheme) -> None:
    assert bp.quant_scheme(flag, _model(tmp_path, qcfg)) == scheme
