"""The plugin object in one process: warm-up plan, routed apply, vLLM-kernel warm-up, and the
lifecycle around vLLM's warm-up (phase -> serving whatever warm-up does). Metrics are the
plugin's own (PluginMetrics) in a test registry; the cross-process channel is
tests/test_worker_metrics.py, the real workers tests/test_plugin.py."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from moe_serve.kernels.moe import configs, routing, selection
from moe_serve.kernels.plugin import jit_monitor, vllm_compat
from moe_serve.kernels.plugin.layer_warmup import LayerShape, VllmCallTemplate, _vllm_group, warmup_plan
from moe_serve.kernels.plugin.plugin_metrics import PluginMetrics
from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.plugin.layer_plan import LayerFacts
from moe_serve.kernels.plugin.vllm_plugin import MoePlugin
from moe_serve.bench.experts.reference import moe_reference, rel_err

E, N, K, TOPK = 4, 16, 32, 2


@pytest.fixture()
def plugin() -> Any:
    p = MoePlugin(PluginConfig(), None)
    p.registry = CollectorRegistry()
    p.metrics = PluginMetrics(0, "optimized", registry=p.registry)
    yield p
    jit_monitor.set_phase("warmup")


def _value(p: Any, name: str, **labels: str) -> float:
    return p.registry.get_sample_value(name, labels) or 0.0


def test_warmup_plan():
    rngs = [{"m_min": 1, "m_max": 16, "backend": "ours"},
            {"m_min": 17, "m_max": 255, "backend": "vllm"},
            {"m_min": 256, "m_max": 256, "backend": "ours"},
            {"m_min": 257, "m_max": None, "backend": "vllm"}]
    plan = warmup_plan(rngs, max_seqs=64, max_tokens=2048, topk=2)
    ms = plan["vllm"]
    assert plan["ours"]
    assert ms[:48] == list(range(17, 65))            # every decode M routed to vLLM
    assert all(routing.route_in(rngs, m) == "vllm" for m in ms)
    assert 256 not in ms and max(ms) <= 2048 and ms == sorted(ms)
    groups = {_vllm_group(m, 2, None) for m in range(65, 2049) if routing.route_in(rngs, m) == "vllm"}
    assert len(ms) - 48 == len(groups)               # one M per specialization class
    assert len(ms) < 48 + 16 * 14
    none = warmup_plan([], max_seqs=8, max_tokens=100, topk=8)
    assert not none["ours"] and none["vllm"][:8] == list(range(1, 9))
    allours = warmup_plan([], 8, 100, 8, policy="ours")
    assert allours["ours"] and allours["vllm"] == []
    capped = warmup_plan([], 512, 8192, 8, max_calls=100)
    assert len(capped["vllm"]) == 100 and capped["dropped"] > 0


def _call(M: int, g: torch.Generator, w1: torch.Tensor, w2: torch.Tensor) -> vllm_compat.ApplyCall:
    x = torch.randn(M, K, generator=g)
    tw, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(TOPK)
    return vllm_compat.ApplyCall(torch.full((M, K), float("nan")), x, w1, w2, tw, ids.to(torch.int32),
                                 SimpleNamespace(name="SILU"), E, None, None, None,
                                 torch.empty(M * TOPK * K), torch.empty(M * TOPK * N), None, False)


def test_apply_routes_per_m(plugin, tmp_path, monkeypatch):
    """Supported calls: M routed to vLLM call the original (counted routed_to_vllm), M routed
    to ours run our kernel (fp32 under the interpreter) and write vLLM's output buffer."""
    dev = configs.device_name()
    table = {"device": dev, "shapes": {routing.shape_key(E, N, K, "fp32"): {"ranges": [
        {"m_min": 1, "m_max": 1, "backend": "ours"}, {"m_min": 2, "m_max": None, "backend": "vllm"}]}}}
    (tmp_path / routing.file_name(dev)).write_text(json.dumps(table))
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv(routing.ROUTING_ENV, raising=False)
    selection.clear_caches()
    plugin.moe.require_cuda = False
    calls = []

    def orig(self, **kw):
        calls.append(kw["hidden_states"].size(0))
        kw["output"].fill_(7.0)

    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    experts = SimpleNamespace(quant_config=None)
    try:
        one, three = _call(1, g, w1, w2), _call(3, g, w1, w2)
        assert plugin.moe.handle(orig, experts, one) is vllm_compat.OUTPUT_WRITTEN
        assert rel_err(one.output, moe_reference(one.hidden_states, w1, w2, one.topk_weights, one.topk_ids)) < 1e-3
        plugin.moe.handle(orig, experts, three)
        assert torch.all(three.output == 7.0)
    finally:
        selection.clear_caches()
    assert calls == [3]
    launches = {p: _value(plugin, "moe_serve_moe_kernel_launches_total", path=p) for p in
                ("optimized", "routed_to_vllm", "fallback")}
    assert launches == {"optimized": 1, "routed_to_vllm": 1, "fallback": 0}
    (shape,) = plugin.layers.pending  # queued for warm-up, with what a vLLM warm-up call needs
    assert (shape.E, shape.N, shape.K, shape.topk, shape.route_dtype) == (E, N, K, TOPK, "fp32")
    assert plugin.layers.vllm_calls[shape].experts is experts


def test_unsupported_call_falls_back_with_its_reason(plugin):
    g = torch.Generator().manual_seed(0)
    call = _call(2, g, torch.zeros(E, 2 * N, K), torch.zeros(E, K, N))
    experts = SimpleNamespace(quant_config=None)
    assert plugin.moe.handle(lambda self, **kw: "vllm-result", experts, call) == "vllm-result"
    assert _value(plugin, "moe_serve_moe_kernel_fallbacks_total", reason="device") == 1
    assert _value(plugin, "moe_serve_moe_kernel_launches_total", path="fallback") == 1
    assert not plugin.layers.pending


def test_warm_vllm_calls_original_at_planned_m(plugin):
    """vLLM's original apply once per planned M with the layer's weights, the kept
    quant/activation arguments and workspaces big enough for M (flat, as _resize_cache views
    them); once per shape."""
    w1, w2 = torch.zeros(E, 2 * N, K), torch.zeros(E, K, N)
    seen = []

    def orig(self, **kw):
        M = kw["hidden_states"].size(0)
        assert kw["w1"] is w1 and kw["w2"] is w2 and self == "layer"
        assert kw["topk_ids"].shape == (M, TOPK) and kw["output"].shape == (M, K)
        assert kw["workspace13"].numel() >= M * TOPK * K and kw["workspace2"].numel() >= M * TOPK * N
        assert kw["activation"] == "silu" and kw["a2_scale"] == "a2"
        assert all(len(set(r.tolist())) == TOPK for r in kw["topk_ids"])
        seen.append(M)

    first = vllm_compat.ApplyCall(torch.zeros(2, K), torch.zeros(2, K), w1, w2, torch.zeros(2, TOPK),
                                  torch.zeros(2, TOPK, dtype=torch.int32), "silu", E, None, None, "a2",
                                  torch.empty(2 * TOPK * K), torch.empty(2 * TOPK * N), None, False)
    shape = LayerShape(E, N, K, TOPK, torch.float32, None, False, False, torch.int32, "cpu")
    plugin.layers.vllm_calls[shape] = VllmCallTemplate.of(orig, "layer", first)
    assert plugin.layers.warm_vllm(shape, [1, 5, 17]) == 3
    assert seen == [1, 5, 17]
    assert plugin.layers.warm_vllm(shape, [1]) == 0


class _Worker:
    """Stands in for a vLLM worker class: the plugin wraps its compile_or_warm_up_model."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def compile_or_warm_up_model(self) -> str:
        if self.fail:
            raise RuntimeError("vLLM's warm-up failed")
        return "compiled"


@pytest.mark.parametrize("vllm_fails", [False, True])
def test_phase_turns_serving_whatever_warmup_does(plugin, vllm_fails):
    """Issue 18 item 6: our warm-up raising is logged and counted; vLLM's own raising still
    propagates; either way the phase is 'serving' afterwards and a compile then counts as one."""
    def boom() -> None:
        raise RuntimeError("forced")

    plugin.layers.warm_pending = boom
    cls = type("Worker", (_Worker,), {})
    assert vllm_compat.wrap_method(cls, vllm_compat.WARMUP_METHOD, plugin._around_vllm_warmup)
    worker = cls(fail=vllm_fails)
    if vllm_fails:
        with pytest.raises(RuntimeError, match="vLLM's warm-up failed"):
            worker.compile_or_warm_up_model()
    else:
        assert worker.compile_or_warm_up_model() == "compiled"
    assert plugin.phase == "serving" and jit_monitor.phase() == "serving"
    assert _value(plugin, "moe_serve_plugin_warmup_failures_total", rank="0") == 2  # before and after
    plugin._on_jit_event("k", jit_monitor.phase(), "compile", {})
    assert _value(plugin, "moe_serve_triton_jit_compiles_total", kernel="k", phase="serving", rank="0") == 1


def _plan(plugin: Any, shape: LayerShape) -> Any:
    """The shape's layer plan, as the MoE hook has it made at the layer's first call."""
    return plugin.plan_for(LayerFacts(shape.E, shape.N, shape.K, shape.topk, shape.route_dtype), None)


def test_one_failing_shape_does_not_stop_the_others(plugin):
    """A shape whose warm-up raises is counted, not retried (also not when seen again while
    serving), and the other shapes still warm."""
    plugin.config = PluginConfig(moe_routing="ours")
    warmed = []

    def warm_variants(E, N, K, *args, **kwargs) -> int:
        if E == 8:
            raise RuntimeError("out of shared memory")
        warmed.append(E)
        return 4

    plugin.layers.warm_variants = warm_variants
    bad = LayerShape(8, N, K, TOPK, torch.float32, None, False, False, torch.int32, "cpu")
    good = LayerShape(E, N, K, TOPK, torch.float32, None, False, False, torch.int32, "cpu")
    plugin.layers.see(bad, _plan(plugin, bad))
    plugin.layers.see(good, _plan(plugin, good))
    plugin.layers.warm_pending()
    assert warmed == [E] and plugin.layers.warmed == {good} and plugin.layers.failed == {bad}
    assert _value(plugin, "moe_serve_plugin_warmup_failures_total", rank="0") == 1
    plugin.serve()
    plugin.layers.see(bad, _plan(plugin, bad))  # seen again while serving: no second attempt
    assert not plugin.layers.pending and warmed == [E]
    assert _value(plugin, "moe_serve_plugin_warmup_failures_total", rank="0") == 1


def test_block_and_per_token_layers_warm_their_own_variants(plugin, monkeypatch):
    """A block-FP8 and a per-token FP8 layer (hidden states fp8, as vLLM hands them over) are
    keyed by their format, and the real warm_moe_variants (interpreter, M up to 8) warms every
    kernel variant a serving call of that layer then launches."""
    from moe_serve.kernels.moe import moe_variants, quant_format
    from moe_serve.kernels.moe.fused_moe import fused_moe
    from moe_serve.kernels.moe.launch import record_launches

    plugin.config = PluginConfig(moe_routing="ours")
    plugin.facts = vllm_compat.WorkerFacts(0, 0, "test", max_num_batched_tokens=8, max_num_seqs=8,
                                           backend="auto", dtype="fp8", activation_dtype="bf16",
                                           tp_size=1)
    warmed: set = set()
    key = moe_variants._variant_key
    monkeypatch.setattr(moe_variants, "_variant_key",
                        lambda *a: warmed.add(key(*a)) or key(*a))
    fp8 = torch.float8_e4m3fn
    block = LayerShape(E, N, K, TOPK, fp8, "block", False, False, torch.int32, "cpu",
                       block_shape=(16, 16))
    token = LayerShape(E, N, K, TOPK, fp8, "per_channel", False, False, torch.int32, "cpu",
                       per_token_act=True)
    assert block.route_dtype == quant_format.block_key(16, 16)
    assert token.route_dtype == quant_format.PER_TOKEN
    for shape in (block, token):
        plugin.layers.see(shape, _plan(plugin, shape))
    plugin.layers.warm_pending()
    assert plugin.layers.warmed == {block, token} and not plugin.layers.failed
    modes = set()
    for shape in (block, token):
        for M in (1, 3, 7):
            x, w1, w2, tw, ids, scales = moe_variants._inputs(
                M, E, N, K, TOPK, fp8, shape.fp8, False, torch.int32, "cpu",
                shape.per_token_act, shape.block_shape)
            with record_launches() as launches:
                fused_moe(x, w1, w2, tw, ids, fp8=scales)
            for kernel, _, args, kwargs in launches:
                assert key(kernel, args, kwargs) in warmed, (shape, M, kwargs)
                modes.add(kwargs.get("A_MODE"))
    assert {4, 5} <= modes                 # per-token and per-group fp8 hidden states
