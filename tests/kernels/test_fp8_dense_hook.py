"""The FP8 dense hook (kernels/plugin/fp8_dense_hook.py) on vLLM's real FP8 linear methods: layers
built, loaded and processed by vLLM itself (bench/experts/dense_fp8.vllm_layer) are marked with
their stored layout at load, and their apply gives float64's result through our kernel (Triton's
interpreter, by the op's test-only switch) at 1..16 tokens and exactly vLLM's own output beyond,
traced whole by torch.compile; what the op cannot take stays vLLM's; the switch, the pins, and
the warm-up of what the op saw. vLLM-CPU builds per-tensor (Fp8LinearMethod) and per-channel
(compressed-tensors) layers with its torch kernels; a block layer needs AMX there, so its layer is
built with the kernel an H100 runs (CUTLASS's block GEMM, whose weight processing is the common
one), and only its small calls (ours) are run."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from moe_serve.bench.experts.dense_fp8 import BLOCK, CHANNEL, TENSOR, fp8_bench_cases, quantize, vllm_apply, vllm_layer
from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.dense import op_fp8
from moe_serve.kernels.plugin import fp8_dense_hook as hk
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin.fp8_dense_pins import PINS
from moe_serve.kernels.tuning import tune_cli

LOG = logging.getLogger("test.fp8_dense")


@pytest.fixture()
def hook(monkeypatch: pytest.MonkeyPatch, tp1: None) -> tuple[hk.Fp8DenseHook, list[int]]:
    """The four methods wrapped (restored afterwards), our kernel on CPU tensors at every bucket;
    the M of each call our kernel ran."""
    for where, apply_name in hk.METHODS:
        cls = vc.load(where)
        for name in (apply_name, hk.LOAD):
            monkeypatch.setattr(cls, name, cls.__dict__[name])
    calls: list[int] = []
    real = op_fp8.dense_gemv_fp8
    monkeypatch.setattr(op_fp8, "dense_gemv_fp8", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setattr(op_fp8, "CPU_INTERPRETER", True)
    monkeypatch.setattr(op_fp8, "UNTUNED_TOO", True)                 # no tuned tables for "cpu"
    h = hk.Fp8DenseHook(LOG)
    assert h.install() == ["Fp8LinearMethod.process_weights_after_loading", "Fp8LinearMethod.apply",
                           "CompressedTensorsW8A8Fp8.process_weights_after_loading",
                           "CompressedTensorsW8A8Fp8.apply_weights"]
    assert h.install() == []                                          # once
    return h, calls


def _layer(N: int, K: int, fmt: str):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    q, scale, deq = quantize(torch.randn(N, K, generator=g) / K ** 0.5, fmt)
    method, layer = vllm_layer(q, scale, fmt, torch.float16)
    return method, layer, deq, g


def _apply(method, layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's apply as vLLM calls it (the wrapped method)."""
    return getattr(method, "apply_weights" if hasattr(method, "apply_weights") else "apply")(layer, x)


@pytest.mark.parametrize("fmt", [TENSOR, CHANNEL])
def test_fp8_layers_give_float64_through_our_kernel_and_vllms_output_beyond(hook, fmt: str) -> None:
    _, calls = hook
    method, layer, deq, g = _layer(12, 272, fmt)
    lay = getattr(layer, hk.MARK)
    assert lay is not None and lay.weight_kn and lay.fmt == fmt and (lay.n, lay.k) == (12, 272)
    theirs = vllm_apply(method, layer)
    for M in (1, 16, 17):
        x = torch.randn(M, 272, generator=g).half()
        y = _apply(method, layer, x)
        assert y.shape == (M, 12) and y.dtype == torch.float16
        if M <= 16:                          # ours: the dequantized weights' product, vLLM's within its noise
            assert rel_err(y, x.double() @ deq.T) < 1e-3
            assert rel_err(y, theirs(x).double()) < 1.3 * rel_err(theirs(x), x.double() @ deq.T) + 1e-3
        else:
            assert torch.equal(y, theirs(x))
    assert calls == [1, 16]


def test_a_block_layer_as_hoppers_cutlass_path_stores_it(hook, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
    from vllm.model_executor.layers.quantization import fp8

    def cutlass_block(activation_quant_key, weight_quant_key, input_dtype, out_dtype, weight_shape, **_):
        return CutlassFp8BlockScaledMMKernel(FP8ScaledMMLinearLayerConfig(
            weight_quant_key=weight_quant_key, activation_quant_key=activation_quant_key,
            weight_shape=weight_shape, input_dtype=input_dtype, out_dtype=out_dtype))

    monkeypatch.setattr(fp8, "init_fp8_linear_kernel", cutlass_block)
    _, calls = hook
    method, layer, deq, g = _layer(136, 272, BLOCK)                   # partial blocks along N and K
    lay = getattr(layer, hk.MARK)
    assert (lay.weight_kn, lay.scale_attr, lay.block_n, lay.block_k) == (False, "weight_scale_inv", 128, 128)
    for M in (1, 2):
        x = torch.randn(M, 272, generator=g).half()
        assert rel_err(method.apply(layer, x), x.double() @ deq.T) < 1e-3
    assert calls == [1, 2]


def test_what_the_op_cannot_take_stays_vllms(hook) -> None:
    _, calls = hook
    h, _ = hook
    method, layer, _, g = _layer(16, 40, CHANNEL)                    # K = 40: not whole 16-byte vectors
    assert getattr(layer, hk.MARK) is None and "16-byte" in h.skipped[f"layer@{id(layer):x}"]
    x = torch.randn(2, 40, generator=g).half()
    assert torch.equal(_apply(method, layer, x), vllm_apply(method, layer)(x))
    method, layer, _, g = _layer(16, 64, TENSOR)
    x = torch.randn(2, 64, generator=g)                               # fp32 x: not the layer's output dtype
    assert torch.equal(method.apply(layer, x), vllm_apply(method, layer)(x))
    assert calls == []


def test_a_switch_that_takes_no_layer_says_so_at_warm_up(hook, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Without a tuned table for this GPU every layer stays vLLM's; the warm-up logs that once, with
    the count of such layers and the command that makes a table."""
    monkeypatch.setattr(op_fp8, "UNTUNED_TOO", False)
    h, calls = hook
    layers = [_layer(16, 64, TENSOR)[:2] for _ in range(3)]
    assert all(getattr(layer, hk.MARK) is None for _, layer in layers)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        h.warm_pending()
        h.warm_pending()
    lines = [r.getMessage() for r in caplog.records if "left to vLLM" in r.getMessage()]
    assert len(lines) == 1 and "3 FP8 linear layer(s)" in lines[0] and "moe-serve tune --model" in lines[0]
    assert calls == []
    command = re.search(r"`moe-serve tune ([^`]*)`", lines[0]).group(1).replace("DIR", "m")
    assert tune_cli.parse_args(command.split()).dense        # the command it names parses, dense search on


def test_torch_compile_traces_the_wrapper_whole(hook) -> None:
    """vLLM compiles its models with fullgraph=True: the wrapper must not break the graph, and the
    graph holds our op for a marked layer."""
    _, calls = hook
    method, layer, deq, g = _layer(32, 256, CHANNEL)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: _apply(method, layer, x) * 2, backend=record, fullgraph=True, dynamic=True)
    for M in (2, 5):
        x = torch.randn(M, 256, generator=g).half()
        assert rel_err(compiled(x), 2 * (x.double() @ deq.T)) < 1e-3
    assert len(graphs) == 1 and "moe_serve.fp8_dense_linear" in graphs[0].code
    assert calls == [2, 5]


def test_install_follows_the_setting_and_the_pins_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hk, "_hook", None)
    assert hk.install(PluginConfig()) == []                                       # off by default
    assert hk.install(PluginConfig(fp8_dense_gemv=True, mode="vllm")) == []
    assert hk.warm_pending() == 0
    assert [pin() for pin in PINS]                                                 # each returns what it checked


def test_warm_up_compiles_what_the_op_saw(hook, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(op_fp8, "_seen", {})
    monkeypatch.setattr(op_fp8, "_fallbacks", {})
    h, calls = hook
    method, layer, _, g = _layer(8, 256, TENSOR)
    _apply(method, layer, torch.randn(3, 256, generator=g).half())
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert h.warm_pending() == 1 and h.warm_pending() == 0                     # once per weight
    assert sorted(set(calls)) == list(range(1, 17))                                # M = 1..16 recorded
    assert "5 variants warmed for M = 1..16" in caplog.text                        # one per bucket


def test_fp8_bench_cases_run_ours_and_vllms_layer_on_the_same_weights(tp1: None) -> None:
    """bench/experts/dense_fp8.fp8_bench_cases: both callables checked (float64, vLLM's noise) and
    giving the same layer's output; no vLLM callable where vLLM-CPU cannot build the layer."""
    ours, theirs, errors = fp8_bench_cases((24, 256), 2, CHANNEL)
    a, b = ours(1).clone(), theirs(1)
    assert a.shape == b.shape == (2, 24) and rel_err(a, b.double()) < 0.1
    assert set(errors) == {"ours", "vllm"} and errors["ours"] < 8e-3 and errors["vllm"] < 0.1
    assert fp8_bench_cases((24, 256), 1, BLOCK)[1] is None


def test_the_step_benchmarks_fp8_piece_is_judged_against_float64_not_vllms_chain(tp1: None) -> None:
    """bench step's fp8_gemv case: its "fused" error is ours against float64 and "chain" vLLM's (a
    W8A8 chain quantizes the activation, ~3e-2 from float64 on the GPU, so fused-vs-chain would
    fail a right kernel); a pass or fail is decided on ours alone."""
    from moe_serve.bench.step import kernel_level, pieces
    from moe_serve.bench.step.shapes import StepShapes

    shapes = StepShapes(name="t", layers=2, hidden=256, q_heads=2, kv_heads=1, head_dim=64, rot_dim=64, experts=8,
                        vocab=32, eps=1e-6, rope_theta=1e6, qk_norm=True)
    case = pieces.fp8_gemv_case("fp8_gemv/o", shapes, 24, 256, 2, CHANNEL)
    errors = case.check()
    assert set(errors) == {"fused", "chain"} and 0 < errors["fused"] < kernel_level.TOLERANCE
    ours, theirs, direct = fp8_bench_cases((24, 256), 2, CHANNEL)
    assert errors == {"fused": direct["ours"], "chain": direct["vllm"]}           # same seed, same cell


def test_fp8_bench_checks_ours_against_the_weights_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the layer stores other weights than the checkpoint's (vLLM's DeepGEMM path requantizes
    block FP8 to power-of-two scales at load), the float64 reference is the stored tensors: a check
    against the checkpoint's dequantized weights would fail a kernel that reads them right."""
    from moe_serve.bench.experts import dense_fp8

    real = dense_fp8.quantize

    def requantized(w: torch.Tensor, fmt: str):
        q, scale, deq = real(w, fmt)
        pow2 = torch.exp2(torch.ceil(torch.log2(scale)))           # UE8M0-like scales, >= the original
        bn, bk = dense_fp8.configs.block_of(fmt)
        full = pow2.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:w.shape[0], :w.shape[1]]
        q2 = (deq.float() / full).clamp(-448, 448).to(q.dtype)      # the stored weights differ from q
        assert not torch.equal(q2.float(), q.float())
        return q2, pow2, deq                                        # deq: the checkpoint's
    monkeypatch.setattr(dense_fp8, "quantize", requantized)
    ours, theirs, _ = fp8_bench_cases((256, 512), 1, BLOCK)          # raises if the check fails
    assert theirs is None and ours(0).shape == (1, 256)
