"""The served model's shapes against the kernel tables (service/kernel_tables.py): a table
tuned under another Triton version counts as refused, and the warning names the tuner."""
from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from moe_serve.kernels.moe import configs, routing, selection
from moe_serve.service import kernel_tables

CONFIG = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
          "intermediate_size": 48, "hidden_size": 64, "torch_dtype": "float16"}
ENTRY = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=True)


def test_refused_tables_are_counted_and_warned(tmp_path, monkeypatch, caplog) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / configs.config_file_name(4, 48, 64, "fp16", "dev")).write_text(
        json.dumps({"1": ENTRY, "triton_version": "0.0.1-other"}))
    (tables / routing.file_name("dev")).write_text(json.dumps({"triton_version": "0.0.1-other", "shapes": {}}))
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tables))
    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path / "cache"))
    selection.clear_caches()
    try:
        statuses = kernel_tables.shape_statuses(str(model), 1, None, "dev")
        (st,) = statuses
        assert not st.tuned and len(st.refused) == 2 and all("0.0.1-other" in why for why in st.refused)
        with caplog.at_level("WARNING"):
            kernel_tables.warn_untuned(statuses, str(model), 1, None, "dev")
        assert "refused" in caplog.text and "moe-serve tune --model" in caplog.text
        registry = CollectorRegistry()
        kernel_tables.export(statuses, registry)
        assert registry.get_sample_value("moe_serve_moe_refused_kernel_tables") == 2
        assert registry.get_sample_value("moe_serve_moe_untuned_shapes") == 1
    finally:
        selection.clear_caches()
