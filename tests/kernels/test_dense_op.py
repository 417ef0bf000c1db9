"""torch.ops.moe_serve.dense_linear (kernels/dense/op.py): registered with a fake implementation,
opaque to torch.compile, F.linear's result at every M -- by our GEMV (here Triton's interpreter on
CPU, through the test-only switches) at 1..8 tokens, by F.linear beyond; without the untuned
switch only at the buckets a tuned table lists -- and the weights it has seen warmed variant by
variant."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_serve.kernels.dense import configs, op
from moe_serve.kernels.moe import configs as moe_configs


@pytest.fixture()
def ours(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Our kernel on CPU tensors (interpreter); the list of the (M, N, K) it ran."""
    calls: list[tuple] = []
    real = op.dense_gemv

    def spy(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> torch.Tensor:
        calls.append((x.shape[0], w.shape[0], w.shape[1]))
        return real(x, w, bias, **kw)

    monkeypatch.setattr(op, "CPU_INTERPRETER", True)
    monkeypatch.setattr(op, "UNTUNED_TOO", True)
    monkeypatch.setattr(op, "dense_gemv", spy)
    return calls


def _weights(N: int, K: int, dtype: torch.dtype = torch.float16, bias: bool = True):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    return w, (torch.randn(N, generator=g).to(dtype) if bias else None), g


def test_registered_with_a_fake_that_gives_shape_and_dtype() -> None:
    schema = str(torch.ops.moe_serve.dense_linear.default._schema)
    assert schema == "moe_serve::dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 5, 64, dtype=torch.bfloat16)
        y = op.dense_linear(x, torch.empty(40, 64, dtype=torch.bfloat16), None)
    assert tuple(y.shape) == (3, 5, 40) and y.dtype == torch.bfloat16
    meta = op.dense_linear(torch.empty(2, 64, device="meta"), torch.empty(24, 64, device="meta"),
                           torch.empty(24, device="meta"))
    assert tuple(meta.shape) == (2, 24) and meta.device.type == "meta"


@pytest.mark.parametrize("M", [1, 5, 8])
def test_eager_calls_match_f_linear_through_our_kernel(ours: list, M: int) -> None:
    w, b, g = _weights(40, 96)
    x = torch.randn(M, 96, generator=g).to(torch.float16)
    out = op.dense_linear(x, w, b)
    assert ours == [(M, 40, 96)]
    ref = x.double() @ w.double().T + b.double()
    assert out.dtype == torch.float16 and torch.allclose(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_beyond_8_tokens_and_unsupported_layouts_are_f_linear(ours: list) -> None:
    w, b, g = _weights(24, 64, torch.float32)
    x = torch.randn(2, 3, 64, generator=g)                      # [..., K]: M = 6 rows, ours
    assert torch.allclose(op.dense_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert ours == [(6, 24, 64)]
    for args in ((torch.randn(9, 64, generator=g), w, b),                   # M > 8
                 (torch.randn(64, 3, generator=g).T, w, b),                # x not contiguous
                 (torch.randn(2, 62, generator=g), w[:, :62], None),      # K % 4 (16 bytes) != 0
                 (torch.randn(2, 64, generator=g), w.T.contiguous().T, b)):   # w not unit stride in K
        assert torch.equal(op.dense_linear(*args), F.linear(*args))
    assert len(ours) == 1
    op.CPU_INTERPRETER = False                                  # (restored by the fixture)
    assert torch.equal(op.dense_linear(x, w, b), F.linear(x, w, b)) and len(ours) == 1   # CPU: never ours


def test_torch_compile_keeps_it_opaque_and_serves_every_m(ours: list) -> None:
    """One graph traced with a dynamic M (fullgraph: no break around the op), compiled by
    Inductor: M = 3 runs our kernel inside it, M = 12 F.linear."""
    w, b, g = _weights(32, 128)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.moe_serve.dense_linear(x * 2.0, w, b).float() + 1.0

    compiled = torch.compile(f, backend=record, dynamic=True, fullgraph=True)
    for M in (3, 12):
        x = torch.randn(M, 128, generator=g).to(torch.float16)
        want = F.linear(x * 2.0, w, b).float() + 1.0
        assert torch.allclose(compiled(x), want, rtol=2e-3, atol=2e-3)
    assert len(graphs) == 1 and "moe_serve.dense_linear" in graphs[0].code
    assert ours == [(3, 32, 128)]


def test_weights_seen_are_warmed_once_per_variant(ours: list) -> None:
    w, b, g = _weights(16, 64, torch.float32, bias=False)
    op.dense_linear(torch.randn(300, 64, generator=g), w, None)   # a prefill: F.linear, weight seen
    key = (16, 64, torch.float32, False, "cpu")
    assert not ours and op.seen()[key][0] is w
    assert op.warm_variants(w, None) == 4                          # BLOCK_M 1, 2, 4, 8
    # every M recorded once, and run where it is the first of its variant (1, 2, 3, 5)
    assert sorted(m for m, _, _ in ours) == [1, 1, 2, 2, 3, 3, 4, 5, 5, 6, 7, 8]


def test_a_small_call_the_data_rules_out_is_remembered_with_its_reason(ours: list) -> None:
    w, b, g = _weights(8, 64, torch.float32)
    x = torch.randn(3 * 64 + 1, generator=g)[1:].view(3, 64)     # 4-byte offset: not 16-byte aligned
    assert torch.equal(op.dense_linear(x, w, b), F.linear(x, w, b)) and not ours
    assert op.fallbacks()[(8, 64, torch.float32, True, "cpu")].startswith("x layout")


def test_as_served_only_the_buckets_a_tuned_table_lists_run_our_kernel(
        ours: list, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(op, "UNTUNED_TOO", False)
    monkeypatch.setattr(op, "_seen", {})
    w, b, g = _weights(40, 96)
    xs = {M: torch.randn(M, 96, generator=g).to(torch.float16) for M in (1, 2, 3)}
    configs.load_table.cache_clear()
    try:
        assert all(torch.equal(op.dense_linear(x, w, b), F.linear(x, w, b)) for x in xs.values())
        assert ours == [] and op.warm_variants(w, b) == 0              # no table: F.linear at every M
        table = {2: configs.default_config(2, 40, 96, "fp16")}          # bucket 2 (M = 2) only
        (tmp_path / configs.table_file_name(40, 96, "fp16", "cpu")).write_text(
            configs.table_json(table, moe_configs.running_triton_version()))
        monkeypatch.setenv("MOE_SERVE_KERNEL_CONFIG_DIR", str(tmp_path))
        configs.load_table.cache_clear()
        for M, x in xs.items():
            ref = x.double() @ w.double().T + b.double()
            assert torch.allclose(op.dense_linear(x, w, b).double(), ref, rtol=2e-3, atol=2e-3), M
        assert ours == [(2, 40, 96)]
        assert op.warm_variants(w, b) == 1 and ours[1:] == [(2, 40, 96), (2, 40, 96)]   # recorded, then run
    finally:
        configs.load_table.cache_clear()
