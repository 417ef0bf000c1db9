"""The dense-GEMV hook (kernels/plugin/dense_hook.py) on vLLM's real classes: with the switch on,
UnquantizedLinearMethod.apply of a real vLLM linear layer and UnquantizedEmbeddingMethod.apply
(the lm_head's) give vLLM's own output through our op (our kernel in Triton's interpreter, by the
op's test-only switch), traced whole by torch.compile; what the kernel cannot take stays vLLM's;
with the switch off the plugin wraps nothing. vLLM-CPU builds its layers with the CPU GEMM, so each
test method gets the GEMM vLLM's apply runs on CUDA (default_unquantized_gemm, F.linear)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from moe_serve.kernels.dense import op
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.config import KEY, PluginConfig
from moe_serve.kernels.plugin.dense_hook import DenseHook
from moe_serve.kernels.plugin.vllm_plugin import MoePlugin


@pytest.fixture()
def hooked(monkeypatch: pytest.MonkeyPatch, tp1: None) -> list[tuple]:
    """The two applies wrapped (restored afterwards), our kernel on CPU tensors; the (M, N, K) of
    each call our kernel ran."""
    for where in vc.DENSE_METHODS:
        cls = vc.load(where)
        monkeypatch.setattr(cls, "apply", cls.apply)          # undone at teardown
    calls: list[tuple] = []
    real = op.dense_gemv
    monkeypatch.setattr(op, "dense_gemv", lambda x, w, b=None, **kw: calls.append((x.shape[0], *w.shape))
                        or real(x, w, b, **kw))
    monkeypatch.setattr(op, "CPU_INTERPRETER", True)
    monkeypatch.setattr(op, "UNTUNED_TOO", True)                  # no tuned tables for "cpu"
    hook = DenseHook(SimpleNamespace(logger=logging.getLogger("test")))
    assert hook.install() == ["UnquantizedLinearMethod.apply", "UnquantizedEmbeddingMethod.apply"]
    assert hook.install() == []                                   # once
    return calls


def _layer(N: int, K: int, dtype: torch.dtype, bias: bool):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(K, N, bias=bias, params_dtype=dtype, disable_tp=True)
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(N, K, generator=g) / K ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(N, generator=g))
    layer.quant_method._gemm_impl = vc.load((vc.LAYER_UTILS, "default_unquantized_gemm"))   # CUDA's
    return layer, g


def _vllm_own(layer, x: torch.Tensor) -> torch.Tensor:
    """What vLLM's unwrapped apply computes for this layer."""
    return type(layer.quant_method).apply.__wrapped__(layer.quant_method, layer, x, layer.bias)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_layers_give_vllms_output_through_our_kernel(hooked: list, dtype, tol, bias: bool) -> None:
    layer, g = _layer(24, 64, dtype, bias)
    for M in (1, 3, 8, 9):
        x = torch.randn(M, 64, generator=g).to(dtype)
        out, out_bias = layer(x)                                  # vLLM's forward -> apply
        assert out_bias is None and out.dtype == dtype
        assert torch.allclose(out.float(), _vllm_own(layer, x).float(), rtol=tol, atol=tol)
    assert hooked == [(1, 24, 64), (3, 24, 64), (8, 24, 64)]     # M = 9: F.linear


def test_the_lm_head_method_too(hooked: list) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter((torch.randn(200, 32, generator=g) / 32 ** 0.5).half(), requires_grad=False)
    UnquantizedEmbeddingMethod().process_weights_after_loading(head)   # vLLM-CPU's GEMM for its own
    x = torch.randn(2, 32, generator=g).half()
    logits = UnquantizedEmbeddingMethod().apply(head, x)
    want = UnquantizedEmbeddingMethod.apply.__wrapped__(UnquantizedEmbeddingMethod(), head, x)
    assert hooked == [(2, 200, 32)] and torch.allclose(logits.float(), want.float(), rtol=2e-3, atol=2e-3)


def test_what_the_kernel_cannot_take_stays_vllms(hooked: list) -> None:
    layer, g = _layer(16, 60, torch.float16, True)               # K = 60: not whole 16-byte vectors
    x = torch.randn(2, 60, generator=g).half()
    assert torch.equal(layer(x)[0], _vllm_own(layer, x))
    other, _ = _layer(16, 64, torch.float16, False)              # vLLM picked another GEMM for it
    other.quant_method._gemm_impl = lambda layer, x, w, b: torch.zeros(x.shape[0], w.shape[0])
    assert not other(torch.ones(2, 64).half())[0].any()
    assert hooked == []


def test_torch_compile_traces_the_wrapper_whole(hooked: list) -> None:
    """vLLM compiles its models with fullgraph=True: the wrapper must not break the graph, and the
    graph holds our op where the wrapper takes the layer."""
    layer, g = _layer(32, 128, torch.float16, True)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: layer(x)[0] * 2, backend=record, fullgraph=True, dynamic=True)
    for M in (2, 5, 16):
        x = torch.randn(M, 128, generator=g).half()
        assert torch.allclose(compiled(x).float(), 2 * _vllm_own(layer, x).float(), rtol=2e-3, atol=4e-3)
    assert len(graphs) == 1 and "moe_serve.dense_linear" in graphs[0].code
    assert [m for m, _, _ in hooked] == [2, 5]


def test_the_plugin_installs_the_hook_only_when_switched_on() -> None:
    def steps(mode: str, environ: dict[str, str], **given: object) -> list[str]:
        config = PluginConfig.from_vllm({KEY: {"mode": mode, **given}}, environ)
        return [name for name, _ in MoePlugin(config, None).kernel_hook_steps()]

    assert "dense gemv" in steps("optimized", {})                 # on by default, under any server
    assert "dense gemv" not in steps("vllm", {})
    assert "dense gemv" not in steps("optimized", {"MOE_SERVE_DENSE_GEMV": "0"})
    assert "dense gemv" in steps("optimized", {"MOE_SERVE_DENSE_GEMV": "0"}, dense_gemv=True)


def test_warm_up_compiles_what_the_op_saw_and_reports_small_calls_left_to_f_linear(
        hooked: list, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(op, "_seen", {})
    monkeypatch.setattr(op, "_fallbacks", {})
    layer, g = _layer(16, 64, torch.float32, False)
    layer(torch.randn(300, 64, generator=g))                      # a prefill: F.linear, the weight seen
    x = torch.randn(2 * 64 + 1, generator=g)[1:].view(2, 64)       # misaligned decode input: F.linear
    assert torch.equal(layer(x)[0], _vllm_own(layer, x)) and hooked == []
    hook = DenseHook(SimpleNamespace(logger=logging.getLogger("test.dense")))
    with caplog.at_level(logging.WARNING, logger="test.dense"):
        assert hook.warm_pending() == 1 and hook.warm_pending() == 0    # once per weight
    assert sorted({m for m, _, _ in hooked}) == list(range(1, 9))      # M = 1..8 recorded, 4 variants run
    assert [r.getMessage() for r in caplog.records] == [
        "moe-serve dense GEMV: weight [16, 64] torch.float32 ran F.linear at <= 8 tokens: x layout: "
        "contiguous and 16-byte aligned"]
