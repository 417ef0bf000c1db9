"""moe_serve.kernels.plugin.layer_plan: a layer's plan holds selection's decision per M (route and config,
for the hot path's look-ups), its router's, and fails closed on what our kernels do not implement."""
from __future__ import annotations

import json

import pytest

from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.moe import configs, routing, selection
from moe_serve.kernels.moe.router_topk import max_tokens
from moe_serve.kernels.plugin import layer_plan
from moe_serve.kernels.plugin.layer_plan import LayerFacts, PlanContext, RouterSpec

E, N, K, TOPK = 8, 1792, 4096, 2
SPEC = RouterSpec(TOPK, "softmax", True, 1.0, None, max_tokens(E, K))
SHIPPED_TRITON = json.loads((configs.CONFIG_DIR / routing.file_name("NVIDIA_H200")).read_text())["triton_version"]


@pytest.fixture(autouse=True)
def _tables(monkeypatch, tmp_path):
    """The shipped tables only, read for this machine's Triton (no tuner cache, no env dir)."""
    monkeypatch.delenv("MOE_SERVE_KERNEL_CONFIG_DIR", raising=False)
    monkeypatch.delenv(routing.ROUTING_ENV, raising=False)
    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path / "cache"))
    selection.clear_caches()
    yield
    selection.clear_caches()


def _plan(fmt: str = "bf16", router: RouterSpec | str | None = SPEC, batch_invariant: bool = False,
          unsupported: str | None = None, device: str = "cpu", triton: str | None = None,
          **settings: object) -> layer_plan.LayerPlan:
    ctx = PlanContext(PluginConfig(**settings), device, triton, "test", batch_invariant)
    return layer_plan.build(LayerFacts(E, N, K, TOPK, fmt, experts_unsupported=unsupported, router=router), ctx)


@pytest.mark.parametrize("device,triton", [("cpu", None), ("NVIDIA_H200", SHIPPED_TRITON)])
def test_the_plan_holds_selections_decision_per_m(device: str, triton: str | None) -> None:
    """On this machine (default rule) and for the H200's shipped tables (a measured routing entry)."""
    plan = _plan(device=device, triton=triton)
    for M in (*range(1, 70), 255, 256, 257, 1000, 5000):
        s = selection.choose(E, N, K, TOPK, "bf16", M, device, triton_version=triton)
        assert plan.config(M) == s.config.config and plan.select(M).path == s.path, M
        assert plan.route(M) == (routing.OURS if s.path != selection.VLLM else routing.VLLM), M
    assert plan.reason is None and plan.describe() == selection.describe(E, N, K, "bf16", device, TOPK, triton)
    assert plan.rule.startswith("routing table") == (device != "cpu"), plan.rule
    assert plan.router_serves(SPEC.max_m) and not plan.router_serves(SPEC.max_m + 1)
    assert "gate GEMM + top-k" in plan.fused(1) and plan.fused(5000) == ()


@pytest.mark.parametrize("policy", ["ours", "vllm"])
def test_the_moe_routing_setting_forces_every_m(policy: str) -> None:
    plan = _plan(moe_routing=policy)
    assert {plan.route(M) for M in (1, 8, 300, 9000)} == {policy} and plan.rule == f"moe_routing={policy}"


def test_batch_invariance_fails_closed() -> None:
    """VLLM_BATCH_INVARIANT: our kernels' fp32 atomics and split-K sum in an order that follows the
    batch, so every M of the experts and the router are vLLM's, said in the plan."""
    plan = _plan(batch_invariant=True)
    assert {plan.route(M) for M in (1, 2, 16, 300)} == {routing.VLLM}
    assert plan.reason_key == "batch_invariant" and "VLLM_BATCH_INVARIANT" in plan.reason
    assert plan.router.spec is None and "VLLM_BATCH_INVARIANT" in plan.router.reason
    assert plan.select(1).fallback == plan.reason and "VLLM_BATCH_INVARIANT" in plan.summary()
    assert any("fail closed: VLLM_BATCH_INVARIANT" in line for line in plan.lines([1]))


def test_an_unsupported_feature_or_router_fails_closed_with_its_reason() -> None:
    plan = _plan(unsupported="activation:GELU")
    assert plan.route(1) == routing.VLLM and plan.reason == "unsupported by ours: activation:GELU"
    router = _plan(router="routing term bias_vl (image tokens' bias): not ours")
    assert router.route(1) == routing.OURS and not router.router_serves(1)
    assert router.router_line().endswith("(routing term bias_vl (image tokens' bias): not ours)")
    assert not _plan(fused_router=False).router_serves(1) and not _plan(router=None).router_serves(1)
    assert _plan(mode="vllm").route(1) == routing.VLLM


def test_config_json_routers() -> None:
    """What explain reads: plain softmax / sigmoid (+ noaux_tc's correction bias) is ours; grouped
    top-k (DeepSeek-V3) and other scoring functions are vLLM's; so is a gate too large for one launch."""
    spec = layer_plan.config_router({"norm_topk_prob": False}, E, K, TOPK)
    assert isinstance(spec, RouterSpec) and (spec.scoring, spec.renormalize, spec.max_m) == ("softmax", False, 16)
    dsv3 = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8}
    assert layer_plan.config_router(dsv3, 256, 7168, 8).startswith("grouped top-k")
    biased = layer_plan.config_router({**dsv3, "n_group": 1, "routed_scaling_factor": 2.5}, 64, 2048, 6)
    assert isinstance(biased, RouterSpec) and biased.bias is not None and biased.scaling == 2.5
    assert layer_plan.config_router({"scoring_func": "sqrtsoftplus"}, E, K, TOPK) == "scoring:sqrtsoftplus"
    assert layer_plan.config_router({}, 1024, 8192, 2) == "gate [1024, 8192] too large for one launch"


@pytest.mark.parametrize("settings, fused_model, fp8_dense, attention", [
    ({}, "the fuse_norm_gemv / fuse_qk_norm_rope setting is off", "the fp8_dense_gemv setting is off",
     "the decode_attention setting is off"),
    ({"fuse_qk_norm_rope": True, "fp8_dense_gemv": True, "decode_attention": True}, None, None, None),
    ({"fuse_norm_gemv": True, "decode_attention": True, "mode": "vllm"}, "mode vllm", "mode vllm", "mode vllm"),
])
def test_the_hook_plan_installs_the_fused_model_classes_the_fp8_gemv_and_decode_attention_only_when_asked(
        settings: dict, fused_model: str | None, fp8_dense: str | None, attention: str | None) -> None:
    plan = layer_plan.HookPlan.of(PlanContext(PluginConfig(**settings), "NVIDIA_H200", None, "test"))
    assert (plan.fused_model, plan.fp8_dense, plan.attention) == (fused_model, fp8_dense, attention)
    invariant = layer_plan.HookPlan.of(PlanContext(PluginConfig(fuse_norm_gemv=True, fp8_dense_gemv=True,
                                                                decode_attention=True),
                                                   "NVIDIA_H200", None, "test", batch_invariant=True))
    assert invariant.fused_model == invariant.fp8_dense == invariant.attention == layer_plan.BATCH_INVARIANT


@pytest.mark.parametrize("fmt", ["fp8_w8a8,block_shape=[128,128]", "fp8"])
def test_the_fp8_moe_gemv_setting_puts_fp8_decode_on_the_weight_streaming_path(fmt: str) -> None:
    """With fp8_moe_gemv, an FP8 layer's M <= 16 run ours on the GEMV path (FP8 weights dequantized
    in registers), each bucket's config a GEMV one; above 16 the table's routing and configs stay."""
    off = _plan(fmt=fmt)
    on = _plan(fmt=fmt, fp8_moe_gemv=True)
    for M in range(1, 17):
        assert on.route(M) == routing.OURS and on.config(M).get("GEMV"), M
        assert on.select(M).path == selection.OURS_DECODE
    for M in (17, 64, 300, 5000):
        assert on.route(M) == off.route(M) and on.config(M) == off.config(M), M
    assert on.rule.startswith(selection.FP8_GEMV) and not any(c.config.get("GEMV") for c in off.choices
                                                              if c.bucket <= 16 and fmt != "fp8")
    assert _plan(fmt="bf16", fp8_moe_gemv=True).ranges == _plan(fmt="bf16").ranges      # FP8 layers only
    assert _plan(fmt=fmt, fp8_moe_gemv=True, batch_invariant=True).reason == layer_plan.BATCH_INVARIANT
