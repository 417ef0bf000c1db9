"""moe_serve.kernels.moe.selection: one decision per (layer shape, M) with its evidence: the path, the
config and its source, the shared-memory fit's changes, the measured ratio, the fallback."""
from __future__ import annotations

import json

import pytest

from moe_serve.kernels.moe import configs, routing, selection

SHIPPED_ROUTING = json.loads((configs.CONFIG_DIR / routing.file_name("NVIDIA_H200")).read_text())
H200 = dict(device="NVIDIA_H200", triton_version=SHIPPED_ROUTING["triton_version"])
MIXTRAL = (8, 1792, 4096, 2, "bf16")            # E, N, K, topk, dtype: a shipped table


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(routing.ROUTING_ENV, raising=False)
    selection.clear_caches()
    yield tmp_path
    selection.clear_caches()


def test_a_tuned_shape_routed_to_ours_names_its_table_and_the_measured_ratio():
    measured = SHIPPED_ROUTING["shapes"]["E=8,N=1792,K=4096,dtype=bf16"]["measured"]
    s = selection.choose(*MIXTRAL, 1, **H200)
    assert s.path == selection.OURS_DECODE and s.fallback is None
    assert s.config.source == configs.SHIPPED and s.config.detail.endswith(
        configs.config_file_name(8, 1792, 4096, "bf16", "NVIDIA_H200"))
    assert s.route.backend == "ours" and s.route.measured_m == 1
    assert s.route.ratio == measured["1"]["speedup"] and s.route.why == measured["1"]["why"]
    assert s.config.config == selection.get_config(1, 8, 1792, 4096, 2, "bf16", **H200)
    aligned = selection.choose(*MIXTRAL, 8, **H200)
    assert aligned.path == selection.OURS_ALIGNED and not aligned.config.config.get("DECODE")


def test_routed_to_vllm_says_why_with_the_nearest_measured_m():
    s = selection.choose(*MIXTRAL, 700, **H200)
    assert s.path == selection.VLLM and s.route.measured_m == 768
    assert s.route.ratio < 1 and s.fallback.startswith("routed to vLLM") and "M=768" in s.fallback


def test_default_rule_names_which_default(env_dir):
    dec = selection.config_choice(1, *MIXTRAL[:4], "bf16", "cpu")
    assert dec.source == selection.DEFAULT_RULE and dec.detail == "decode-path heuristic"
    assert selection.config_choice(64, *MIXTRAL[:4], "bf16", "cpu").detail == "aligned-path heuristic"
    rc = selection.route_choice(8, 1792, 4096, "bf16", 1, "cpu", topk=2)
    assert rc.rule == f"{selection.DEFAULT_RULE} (no routing table names the shape)" and rc.backend == "ours"
    assert selection.route_choice(8, 1792, 4096, "bf16", 1, "cpu").why.startswith("top-k unknown")


def test_shared_memory_fit_is_recorded(env_dir, caplog):
    big = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP_AB=True)
    (env_dir / configs.config_file_name(4, 48, 64, "bf16", "dev")).write_text(json.dumps({"1": big}))
    with caplog.at_level("INFO", logger="moe_serve.kernels.moe.selection"):
        choice = selection.config_choice(1, 4, 48, 64, 2, "bf16", "dev")
    assert choice.source == configs.ENV_DIR and choice.config["num_stages"] == 3
    assert "num_stages 4->3" in choice.shrunk and "num_stages 4->3" in caplog.text
    assert selection.config_choice(1, 4, 48, 64, 2, "fp8", "dev").shrunk == ()   # no table: default fits


def test_a_refused_config_table_voids_its_measured_routing(env_dir):
    entry = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=True)
    (env_dir / configs.config_file_name(4, 48, 64, "bf16", "dev")).write_text(
        json.dumps({"1": entry, "triton_version": "0.0.1-other"}))
    ranges = [{"m_min": 1, "m_max": None, "backend": "ours"}]
    (env_dir / routing.file_name("dev")).write_text(json.dumps(
        {"shapes": {routing.shape_key(4, 48, 64, "bf16"): {"ranges": ranges}}}))
    assert selection.route(4, 48, 64, "bf16", 4096, "dev", topk=2) == "vllm"   # default rule
    rc = selection.route_choice(4, 48, 64, "bf16", 4096, "dev", topk=2)
    assert "refused" in rc.rule
    s = selection.choose(4, 48, 64, 2, "bf16", 4096, "dev")
    assert s.config.source == selection.DEFAULT_RULE and s.config.refused and s.path == selection.VLLM
    # the same routing entry serves a shape whose table is usable
    (env_dir / configs.config_file_name(4, 48, 64, "bf16", "dev")).write_text(json.dumps({"1": entry}))
    selection.clear_caches()
    assert selection.route(4, 48, 64, "bf16", 4096, "dev", topk=2) == "ours"


def test_env_policy_and_unsupported_layers(env_dir, monkeypatch):
    monkeypatch.setenv(routing.ROUTING_ENV, "vllm")
    forced = selection.choose(*MIXTRAL, 1, **H200)
    assert forced.path == selection.VLLM and forced.route.rule == "moe_routing=vllm"
    assert selection.describe(8, 1792, 4096, "bf16", **H200) == "all:vllm"
    monkeypatch.setenv(routing.ROUTING_ENV, "ours")
    blocked = selection.choose(*MIXTRAL, 1, **H200, unsupported="fp8_block")
    assert blocked.path == selection.VLLM and blocked.fallback == "unsupported by ours: fp8_block"


def test_untuned_block_and_per_token_fp8_route_to_vllm():
    """Block-scaled and per-token FP8 have no default rule (their untuned decode path measured
    slower than vLLM's): a shape no table names goes to vLLM at every M, saying why; per-tensor
    fp8 and bf16 keep the default rule."""
    from moe_serve.kernels.moe import quant_format, selection

    for fmt in (quant_format.block_key(128, 128), "fp8_w8a8,per_token"):
        for M in (1, 4, 64):
            choice = selection.route_choice(3, 256, 512, fmt, M, "NVIDIA_H200", topk=2)
            assert choice.backend == "vllm" and "untuned" in choice.why
        assert selection.ranges(3, 256, 512, fmt, "NVIDIA_H200", topk=2) == []
    for dt in ("bf16", "fp8"):
        assert selection.route(3, 256, 512, dt, 1, "NVIDIA_H200", topk=1) == "ours"
