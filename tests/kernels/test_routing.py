"""Routing table (kernels/routing.py, kernels/make_routing.py) and the plugin's routed apply."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels import configs, make_routing, routing
from kernels.config_schema import label
from kernels import plugin_moe_hook as hook
from kernels import plugin_state
from kernels import plugin_warmup as pw

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "kernels/configs" / routing.file_name("NVIDIA_H200")
RESULTS = [ROOT / src for src in json.loads(SHIPPED.read_text())["sources"]]  # its raw files


def test_ranges_are_conservative():
    r = make_routing.build_ranges({1: 1.10, 2: 1.2, 4: 1.05, 16: 1.01, 64: 1.3, 256: None})
    assert routing.route_in(r, 1) == "ours"
    assert routing.route_in(r, 3) == "ours"          # both neighbours >= 1.02, 2x apart
    assert routing.route_in(r, 4) == "ours"
    assert routing.route_in(r, 5) == "vllm"          # 16 is below the threshold
    assert routing.route_in(r, 16) == "vllm"
    assert routing.route_in(r, 40) == "vllm"
    assert routing.route_in(r, 64) == "ours"         # measured point itself
    assert routing.route_in(r, 65) == "vllm"         # 256 errored
    assert routing.route_in(r, 10 ** 6) == "vllm"    # above the largest measured M
    assert r[-1] == {"m_min": 65, "m_max": None, "backend": "vllm"}  # merged
    assert make_routing.build_ranges({1: 1.019}) == [{"m_min": 1, "m_max": None, "backend": "vllm"}]
    wide = make_routing.build_ranges({256: 1.1, 4096: 1.1})   # 16x apart: no interpolation
    assert routing.route_in(wide, 512) == "vllm" and routing.route_in(wide, 4096) == "ours"


@pytest.mark.skipif(not all(p.exists() for p in RESULTS), reason="H200 results not in the tree")
def test_shipped_table_is_generated_from_the_results():
    table = make_routing.build([json.loads(p.read_text()) for p in RESULTS], "NVIDIA_H200", [])
    shipped = json.loads(SHIPPED.read_text())
    assert {k: v["ranges"] for k, v in table["shapes"].items()} == \
        {k: v["ranges"] for k, v in shipped["shapes"].items()}


def test_routed_to_ours_configs_are_the_measured_ones():
    """Every measured M routed to ours still gets the config that was measured (the shared
    memory fit must not have changed a winning config). Checked where the config does not
    depend on the machine: tuned tables and the decode heuristic. (An untuned shape's aligned
    config comes from vLLM's lookup for the GPU it runs on, which a CPU cannot reproduce.)"""
    shipped = json.loads(SHIPPED.read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    n = 0
    for key, ent in shipped["shapes"].items():
        E, N, K = (int(p.split("=")[1]) for p in key.split(",")[:3])
        dt = key.split("dtype=")[1]
        for m, meas in ent["measured"].items():
            if routing.route_in(ent["ranges"], int(m)) != "ours":
                continue
            cfg = configs.get_config(int(m), E, N, K, ent["topk"], dt, "NVIDIA_H200")
            if not (configs.load_table(E, N, K, dt, "NVIDIA_H200") or cfg.get("DECODE")):
                continue
            assert label(cfg) == meas["cfg"], (key, m)
            n += 1
    assert n >= 5


def test_route_unmeasured_and_policy(monkeypatch):
    assert routing.route(3, 48, 64, "bf16", 1, "NVIDIA_H200") == "vllm"     # never measured
    assert routing.route(3, 48, 64, "bf16", 1, "NVIDIA_H200", topk=1) == "ours"   # default rule
    assert routing.route(3, 48, 64, "bf16", 4, "NVIDIA_H200", topk=1) == "vllm"   # 4 > E
    assert routing.route(128, 96, 2048, "fp8", 4, "NVIDIA_H200") == "ours"  # Qwen3 fp8 M=4
    assert routing.route(8, 1792, 4096, "fp8", 1, "NVIDIA_H200") == "ours"  # Mixtral fp8 M=1
    assert routing.route(8, 1792, 4096, "fp8", 64, "NVIDIA_H200") == "vllm"  # M=64: < 1.02x
    assert routing.route(8, 1792, 4096, "bf16", 1, "some_gpu") == "vllm"    # no table
    monkeypatch.setenv(routing.ROUTING_ENV, "ours")
    assert routing.route(3, 48, 64, "bf16", 1, "NVIDIA_H200") == "ours"
    monkeypatch.setenv(routing.ROUTING_ENV, "vllm")
    assert routing.route(128, 96, 2048, "fp8", 4, "NVIDIA_H200") == "vllm"


def test_warmup_plan():
    rngs = [{"m_min": 1, "m_max": 16, "backend": "ours"},
            {"m_min": 17, "m_max": 255, "backend": "vllm"},
            {"m_min": 256, "m_max": 256, "backend": "ours"},
            {"m_min": 257, "m_max": None, "backend": "vllm"}]
    plan = pw.warmup_plan(rngs, max_seqs=64, max_tokens=2048, topk=2, E=8)
    ms = plan["vllm"]
    assert plan["ours"]
    assert ms[:48] == list(range(17, 65))            # every decode M routed to vLLM
    assert all(routing.route_in(rngs, m) == "vllm" for m in ms)
    assert 256 not in ms and max(ms) <= 2048 and ms == sorted(ms)
    groups = {pw._vllm_group(m, 2, None) for m in range(65, 2049)
              if routing.route_in(rngs, m) == "vllm"}
    assert len(ms) - 48 == len(groups)               # one M per specialization class
    assert len(ms) < 48 + 16 * 14
    none = pw.warmup_plan([], max_seqs=8, max_tokens=100, topk=8, E=128)
    assert not none["ours"] and none["vllm"][:8] == list(range(1, 9))
    allours = pw.warmup_plan([], 8, 100, 8, 128, policy="ours")
    assert allours["ours"] and allours["vllm"] == []
    capped = pw.warmup_plan([], 512, 8192, 8, 128, max_calls=100)
    assert len(capped["vllm"]) == 100 and capped["dropped"] > 0


def test_apply_routes_per_m(tmp_path, monkeypatch):
    """Supported calls: M routed to vLLM call the original (counted routed_to_vllm), M routed
    to ours run our kernel (fp32 under the interpreter) and write vLLM's output buffer."""
    from tests.kernels.reference import moe_reference, rel_err

    E, N, K, topk = 4, 16, 32, 2
    dev = configs.device_name()
    table = {"device": dev, "shapes": {routing.shape_key(E, N, K, "fp32"): {"ranges": [
        {"m_min": 1, "m_max": 1, "backend": "ours"},
        {"m_min": 2, "m_max": None, "backend": "vllm"}]}}}
    (tmp_path / routing.file_name(dev)).write_text(json.dumps(table))
    monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv(routing.ROUTING_ENV, raising=False)
    routing.load.cache_clear()
    monkeypatch.setattr(hook, "unsupported_reason", lambda *a, **k: None)
    calls = []

    def orig(self, **kw):
        calls.append(kw["hidden_states"].size(0))
        kw["output"].fill_(7.0)

    apply = hook.make_apply(orig)
    rep = plugin_state.report()
    before = dict(rep.data.get("moe_calls") or {})
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    try:
        for M in (1, 3):
            x = torch.randn(M, K, generator=g)
            tw, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(topk)
            out = torch.full((M, K), float("nan"))
            apply(SimpleNamespace(quant_config=None), output=out, hidden_states=x, w1=w1, w2=w2,
                  topk_weights=tw, topk_ids=ids.to(torch.int32), activation="silu",
                  global_num_experts=E, expert_map=None, a1q_scale=None, a2_scale=None,
                  workspace13=torch.empty(M * topk * K), workspace2=torch.empty(M * topk * N),
                  expert_tokens_meta=None, apply_router_weight_on_input=False)
            if M == 1:
                assert rel_err(out, moe_reference(x, w1, w2, tw, ids)) < 1e-3
            else:
                assert torch.all(out == 7.0)
    finally:
        routing.load.cache_clear()
    after = rep.data["moe_calls"]
    assert calls == [3]
    assert after.get("optimized", 0) - before.get("optimized", 0) == 1
    assert after.get("routed_to_vllm", 0) - before.get("routed_to_vllm", 0) == 1
    assert after.get("fallback", 0) == before.get("fallback", 0)
    assert plugin_state.vllm_ctx  # the shape's vLLM warm-up context was kept


def test_warm_vllm_calls_original_at_planned_m(monkeypatch):
    """warm_vllm runs vLLM's original apply once per planned M with the layer's weights, the
    kept quant/activation arguments and workspaces big enough for M (flat, as _resize_cache
    views them)."""
    E, N, K, topk = 4, 16, 32, 2
    w1, w2 = torch.zeros(E, 2 * N, K), torch.zeros(E, K, N)
    seen = []

    def orig(self, **kw):
        M = kw["hidden_states"].size(0)
        assert kw["w1"] is w1 and kw["w2"] is w2 and self == "layer"
        assert kw["topk_ids"].shape == (M, topk) and kw["output"].shape == (M, K)
        assert kw["workspace13"].numel() >= M * topk * K
        assert kw["workspace2"].numel() >= M * topk * N
        assert kw["activation"] == "silu" and kw["a2_scale"] == "a2"
        assert all(len(set(r.tolist())) == topk for r in kw["topk_ids"])
        seen.append(M)

    key = ("test-shape",)
    monkeypatch.setitem(plugin_state.vllm_ctx, key, {
        "orig": orig, "experts": "layer", "w1": w1, "w2": w2, "activation": "silu",
        "global_num_experts": E, "a1q_scale": None, "a2_scale": "a2", "router_on_input": False,
        "hidden_dtype": torch.float32, "out_dtype": torch.float32, "ids_dtype": torch.int32,
        "tw_dtype": torch.float32, "topk": topk, "ws13_dtype": torch.float32,
        "ws2_dtype": torch.float32, "ws13_per_row": topk * K, "ws2_per_row": topk * N})
    monkeypatch.setattr(pw, "vllm_warmed", set())
    assert pw.warm_vllm(key, [1, 5, 17]) == 3
    assert seen == [1, 5, 17]
    assert pw.warm_vllm(key, [1]) == 0          # once per shape


def test_routing_info_metric(tmp_path):
    from kernels.jit_export import WorkerCollector

    (tmp_path / "worker-1.json").write_text(json.dumps({
        "pid": 1, "rank": 0, "mode": "optimized",
        "kernel_info": {"routing": {"E=8,N=1792,K=4096,dtype=bf16": "1-16:ours,17+:vllm"}}}))
    fams = {f.name: f for f in WorkerCollector(tmp_path).collect()}
    samples = fams["moe_serve_moe_routing_info"].samples
    assert [(s.labels["shape"], s.labels["routing"]) for s in samples] == \
        [("E=8,N=1792,K=4096,dtype=bf16", "1-16:ours,17+:vllm")]
