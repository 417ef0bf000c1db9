"""The fused custom ops (moe_serve.kernels.fused.ops): on CPU tensors exactly vLLM's layers (RMSNorm and
get_rope forward_native, the linear layer, reshape_and_cache_flash's write); with the kernels
run under the interpreter (ops.CPU_INTERPRETER) the same within the kernels' tolerance, the
GEMV's token limit taken by the row-norm kernel; traced by torch.compile as one node each, with
the fake implementations' shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_serve.kernels import config as plugin_config
from moe_serve.kernels.dense import configs as dense_configs
from moe_serve.kernels.fused import ops, reference
from moe_serve.kernels.moe.launch import kernel_name, record_launches
from tests.kernels._fused_vllm import close, generator, vllm_config, vllm_rms_norm, vllm_rope

EPS = 1e-6
Hq, Hkv, D, MAX_POS = 4, 2, 32, 64


def _norm_inputs(M: int, K: int, N: int, dtype: torch.dtype):
    g = generator()
    return (torch.randn(M, K, generator=g).to(dtype), torch.randn(M, K, generator=g).to(dtype),
            (1 + 0.3 * torch.randn(K, generator=g)).to(dtype), (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype))


def _qk_inputs(T: int, dtype: torch.dtype):
    g = generator()
    return (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype), torch.randint(0, MAX_POS, (T,), generator=g),
            (1 + 0.3 * torch.randn(D, generator=g)).to(dtype), (1 + 0.3 * torch.randn(D, generator=g)).to(dtype))


@pytest.fixture
def norm_gemv_tables(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """write(N, K, dtype, buckets): a tuned "norm_gemv" table (the GEMV's heuristic config at each
    bucket) on the CPU "device", in a kernel config dir this test's plugin config names."""
    import triton

    plugin_config.configure(plugin_config.PluginConfig(kernel_config_dir=str(tmp_path)))
    dense_configs.load_table.cache_clear()

    def write(N: int, K: int, dtype: str, buckets: tuple[int, ...]) -> None:
        name = dense_configs.table_file_name(N, K, dtype, "cpu", dense_configs.NORM_GEMV)
        (tmp_path / name).write_text(dense_configs.table_json(
            {b: dense_configs.default_config(b, N, K, dtype) for b in buckets}, triton.__version__))
        dense_configs.load_table.cache_clear()

    yield write
    plugin_config.configure(None)
    dense_configs.load_table.cache_clear()


@pytest.mark.parametrize("residual", [True, False])
def test_norm_linear_on_cpu_is_vllms_layer(residual: bool) -> None:
    x, r, nw, w = _norm_inputs(5, 64, 24, torch.float16)
    r = r if residual else None
    y, res_out, h = ops.fused_norm_linear(x, r, nw, EPS, w, None, write_h=True)
    with vllm_config():
        out = vllm_rms_norm(nw, EPS).forward_native(x.clone(), None if r is None else r.clone())
    h_v, res_v = out if residual else (out, x)
    assert torch.equal(h, h_v) and torch.equal(res_out, res_v) and torch.equal(y, F.linear(h_v, w))
    assert (res_out is x) == (not residual)
    assert ops.fused_norm_linear(x, r, nw, EPS, w)[2] is None


def test_qk_norm_rope_on_cpu_is_vllms_layer() -> None:
    qkv, pos, qw, kw = _qk_inputs(3, torch.float16)
    with vllm_config():
        rope = vllm_rope(D, D, MAX_POS, True, torch.float16)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
        q_v = vllm_rms_norm(qw, EPS).forward_native(q.reshape(3, Hq, D)).reshape(3, -1)
        k_v = vllm_rms_norm(kw, EPS).forward_native(k.reshape(3, Hkv, D)).reshape(3, -1)
        q_v, k_v = rope.forward_native(pos, q_v, k_v)
    kc, vc = torch.zeros(2, 4, Hkv, D, dtype=torch.float16), torch.zeros(2, 4, Hkv, D, dtype=torch.float16)
    slots = torch.tensor([6, -1, 1])
    q_o, k_o = ops.fused_qk_norm_rope(qkv, pos, qw, kw, EPS, rope.cos_sin_cache, Hq, Hkv, D, D, True,
                                      kv_cache=(kc, vc, slots))
    assert torch.equal(q_o, q_v) and torch.equal(k_o, k_v)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.write_kv_cache(k_v.reshape(3, Hkv, D), v.reshape(3, Hkv, D), want_k, want_v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v) and kc.abs().sum() > 0


def test_kernels_behind_the_ops_under_the_interpreter(monkeypatch: pytest.MonkeyPatch, norm_gemv_tables) -> None:
    """The fused GEMV at 3 tokens (its table lists that bucket), the row-norm kernel + the GEMM at
    1 (a bucket the table leaves out) and at 17 (past the GEMV's limit), Q/K norm + RoPE with the
    cache; each against the CPU path (vLLM's semantics), each on the kernel it should run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "CPU_INTERPRETER", True)
    norm_gemv_tables(12, 64, "fp16", (4,))
    for M, kernel in ((3, "norm_gemv_kernel"), (1, "add_rms_norm_kernel"), (17, "add_rms_norm_kernel")):
        x, r, nw, w = _norm_inputs(M, 64, 12, torch.float16)
        with record_launches() as launches:                           # recorded, not run
            ops.fused_norm_linear(x, r, nw, EPS, w, None, write_h=True)
        assert [kernel_name(launch[0]) for launch in launches] == [kernel], M
        y, res_out, h = ops.fused_norm_linear(x, r, nw, EPS, w, None, write_h=True)
        y_r, res_r, h_r = reference.norm_linear(x, r, nw, EPS, w, None)
        assert torch.equal(res_out, res_r) and close(h, h_r, torch.float16, ulps=2)
        assert close(y, y_r, torch.float16, ulps=2)
    qkv, pos, qw, kw = _qk_inputs(4, torch.float32)
    cs = torch.randn(MAX_POS, D // 2)
    kc, vc, slots = torch.zeros(2, 4, Hkv, D), torch.zeros(2, 4, Hkv, D), torch.arange(4)
    q, k = ops.fused_qk_norm_rope(qkv, pos, qw, kw, EPS, cs, Hq, Hkv, D, D // 2, False, kv_cache=(kc, vc, slots))
    q_r, k_r = reference.qk_norm_rope(qkv, pos, qw, kw, EPS, cs, Hq, Hkv, D, D // 2, False)
    assert close(q, q_r, torch.float32) and close(k, k_r, torch.float32)
    assert torch.equal(kc.view(8, Hkv, D)[slots], k.reshape(4, Hkv, D))
    assert torch.equal(vc.view(8, Hkv, D)[slots], qkv[:, (Hq + Hkv) * D:].reshape(4, Hkv, D))


def test_ops_trace_as_one_node_each_under_torch_compile() -> None:
    """fullgraph, dynamic token count: the graph Dynamo hands the backend holds each op once
    (opaque to the compiler); the compiled function computes what the eager ops do."""
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x, r, nw, w = _norm_inputs(4, 64, 3 * D * 2 + 2 * D, torch.float32)   # QKV's width: (Hq + 2 Hkv) * D
    pos = torch.arange(4)
    cs = torch.randn(MAX_POS, D)
    kc, vc = torch.zeros(2, 4, Hkv, D), torch.zeros(2, 4, Hkv, D)

    def layer(x, r, pos):
        qkv, res, _ = ops.fused_norm_linear(x, r, nw, EPS, w)
        q, k = ops.fused_qk_norm_rope(qkv, pos, nw[:D], nw[:D], EPS, cs, Hq, Hkv, D, D, True,
                                      kv_cache=(kc, vc, pos))
        return q * 2, k, res

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    got, want = compiled(x, r, pos), layer(x, r, pos)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sum("fused_norm_linear" in s for s in seen) == 1 and sum("fused_qk_norm_rope_cache" in s for s in seen) == 1
    fake = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)(x[:3], r[:3], pos[:3])
    assert [tuple(t.shape) for t in fake] == [(3, Hq * D), (3, Hkv * D), (3, 64)]


def test_warm_up_runs_each_variant_of_each_call_kind_seen_once(monkeypatch: pytest.MonkeyPatch,
                                                               norm_gemv_tables) -> None:
    """The op records each call kind (at any M: vLLM's profile run is a prefill); warm_pending
    then runs each distinct norm GEMV variant of the M its table lists (buckets 1 and 4 here: M =
    1, 3, 4) and the Q/K kernel once, and nothing again on a second call."""
    from moe_serve.kernels.fused import warmup

    monkeypatch.setattr(ops, "CPU_INTERPRETER", True)
    monkeypatch.setattr(ops, "_seen_norm", {})
    monkeypatch.setattr(ops, "_seen_qk", {})
    monkeypatch.setattr(warmup, "_warmed", set())
    norm_gemv_tables(8, 64, "fp32", (1, 4))
    x, r, nw, w = _norm_inputs(20, 64, 8, torch.float32)
    ops.fused_norm_linear(x, r, nw, EPS, w)                              # 20 tokens: the row-norm path
    qkv, pos, qw, kw = _qk_inputs(2, torch.float32)
    ops.fused_qk_norm_rope(qkv, pos, qw, kw, EPS, torch.randn(MAX_POS, D), Hq, Hkv, D, D, True)
    assert list(ops.seen_norm_linear()) == [(8, 64, torch.float32, False, True, False, "cpu")]
    runs = []
    real = warmup.ng.norm_gemv
    monkeypatch.setattr(warmup.ng, "norm_gemv", lambda x, *a, **k: runs.append(x.shape[0]) or real(x, *a, **k))
    assert warmup.warm_pending() == 2
    twice = sorted(m for m in set(runs) if runs.count(m) == 2)           # recorded at every tabled M, run
    assert twice == [1, 3] and sorted(set(runs)) == [1, 3, 4]             # at the first M of each bucket
    assert warmup.warm_pending() == 0


@pytest.mark.parametrize("residual,write_h", [(False, False), (True, True)])
def test_opcheck_schemas_fakes_and_aliasing(residual: bool, write_h: bool) -> None:
    """torch.library.opcheck: each op's schema (mutations declared, no output aliasing an input
    or another output), its fake implementation against the real one, and its tracing."""
    x, r, nw, w = _norm_inputs(3, 64, 16, torch.float32)
    torch.library.opcheck(torch.ops.moe_serve.fused_norm_linear, (x, r if residual else None, nw, EPS, w, None, write_h))
    qkv, pos, qw, kw = _qk_inputs(3, torch.float32)
    cs = torch.randn(MAX_POS, D)
    args = (qkv, pos, qw, kw, EPS, cs, Hq, Hkv, D, D, True)
    torch.library.opcheck(torch.ops.moe_serve.fused_qk_norm_rope, args)
    cache = (torch.zeros(2, 4, Hkv, D), torch.zeros(2, 4, Hkv, D), torch.tensor([3, -1, 6]))
    torch.library.opcheck(torch.ops.moe_serve.fused_qk_norm_rope_cache, (*args, *cache))
