"""The decode-attention hook (moe_serve.kernels.plugin.attention_hook) under TRITON_INTERPRET=1:
the wrapper around an attention impl with FlashAttentionImpl's forward parameters and
attributes, a KV cache in FlashAttention's layout (logical [blocks, Hkv, block_size, 2 D] over a
physical NHD buffer), metadata as FlashAttention's builder makes it. A plain decode batch goes to
our kernel (float64 reference, NaN-poisoned output, padded sequences of length 0 write nothing),
everything else to vLLM's forward with the reason; the profile run's shapes are compiled by
warm_pending; a failed pin installs nothing."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.attention import bench_cases
from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.plugin import attention_hook as ah

Hq, Hkv, D, BS = 8, 2, 32, 16


@dataclass
class Impl:
    """FlashAttentionImpl's attributes the hook reads; forward records the calls it got."""

    head_size: int = D
    num_kv_heads: int = Hkv
    scale: float = D ** -0.5
    attn_type: str = "decoder"
    alibi_slopes: Any = None
    sliding_window: Any = None
    logits_soft_cap: Any = None
    sinks: Any = None
    kv_cache_dtype: str = "auto"
    dcp_world_size: int = 1
    calls: list = field(default_factory=list)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        self.calls.append(attn_metadata)
        return output


def _batch(lens: list[int], padded: int, seed: int = 0):
    """query [padded, Hq, D], the FlashAttention-layout kv_cache, metadata, and the float64 answer
    of the real sequences (lens: one per sequence, 0 for a padded one)."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-n // BS) for n in lens)
    blocks = len(lens) * pages + 1
    physical = torch.randn(blocks, BS, Hkv, 2 * D, generator=g).half()          # NHD
    kv_cache = physical.permute(0, 2, 1, 3)                                      # logical [blocks, Hkv, BS, 2 D]
    table = torch.randperm(blocks, generator=g)[:len(lens) * pages].view(len(lens), pages).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(padded, Hq, D, generator=g).half()
    md = SimpleNamespace(max_query_len=1, seq_lens=seq_lens, block_table=table, use_cascade=False, causal=True,
                         sliding_window=None, mm_prefix_range_tensor=None, rswa_prefix_lens=None)
    k, v = physical.split(D, dim=-1)
    real = [b for b, n in enumerate(lens) if n]
    want = bench_cases.float64_attention(bench_cases.Inputs(query[real], k, v, table[real], seq_lens[real], D ** -0.5))
    return query, kv_cache, md, real, want


def _wrapped(hook: ah.AttentionHook):
    impl = Impl()
    return impl, hook.forward(Impl.forward)


def test_a_decode_batch_runs_our_kernel() -> None:
    hook = ah.AttentionHook(logging.getLogger("t"))
    impl, forward = _wrapped(hook)
    query, kv_cache, md, real, want = _batch([70, 0, 5], padded=4)     # one padded sequence, one padded token
    out = torch.full((4, Hq, D), float("nan"), dtype=torch.float16)
    assert forward(impl, None, query, None, None, kv_cache, md, out) is out and impl.calls == []
    assert rel_err(out[real], want) < 2e-3
    assert out[1].isnan().all() and out[3].isnan().all()                  # length 0, and past seq_lens: untouched


@pytest.mark.parametrize("change, reason", [
    ({"max_query_len": 3}, "not a decode batch"),
    ({"use_cascade": True}, "cascade"),
    ({"causal": torch.ones(3, dtype=torch.bool)}, "causal"),
    ({"rswa_prefix_lens": torch.zeros(3)}, "R-SWA"),
])
def test_other_calls_run_vllms_forward(change: dict, reason: str) -> None:
    hook = ah.AttentionHook(logging.getLogger("t"))
    impl, forward = _wrapped(hook)
    query, kv_cache, md, _, _ = _batch([20, 9, 3], padded=3)
    for k, v in change.items():
        setattr(md, k, v)
    assert reason in ah.call_unsupported(impl, query, kv_cache, md, torch.empty(3, Hq, D), False)
    forward(impl, None, query, None, None, kv_cache, md, torch.empty(3, Hq, D, dtype=torch.float16))
    assert impl.calls == [md]


@pytest.mark.parametrize("attr, value, reason", [
    ("logits_soft_cap", 30.0, "soft-capping"), ("sliding_window", (127, 0), "sliding window"),
    ("alibi_slopes", torch.ones(Hq), "ALiBi"), ("sinks", torch.zeros(Hq), "sinks"),
    ("kv_cache_dtype", "fp8", "KV cache dtype fp8"), ("attn_type", "encoder_only", "attention type"),
])
def test_a_layer_with_a_feature_our_kernel_lacks_keeps_vllms_attention(attr: str, value: Any, reason: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    hook = ah.AttentionHook(logging.getLogger("t"))
    impl, forward = _wrapped(hook)
    setattr(impl, attr, value)
    query, kv_cache, md, _, _ = _batch([20], padded=1)
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(2):
            forward(impl, None, query, None, None, kv_cache, md, torch.empty(1, Hq, D, dtype=torch.float16))
    assert len(impl.calls) == 2 and reason in getattr(impl, ah.WHY)
    assert caplog.text.count("FlashAttention serves layers with") == 1        # once per reason


def test_the_profile_run_is_vllms_and_its_shapes_are_compiled_before_serving() -> None:
    hook = ah.AttentionHook(logging.getLogger("t"))
    impl, forward = _wrapped(hook)
    forward(impl, None, torch.zeros(4, Hq, D, dtype=torch.float16), None, None, torch.empty(0), None,
            torch.empty(4, Hq, D, dtype=torch.float16))
    assert impl.calls == [None] and hook.pending == {("cpu", torch.float16, Hq, Hkv, D)}
    assert hook.warm_pending() == 1 and hook.warm_pending() == 0


def test_install_needs_the_setting_and_a_holding_pin(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Off (the default, or mode vllm): nothing. On: this vLLM's FlashAttentionImpl.forward wrapped
    once (restored after the test). A pin that fails: nothing, with the pin's message."""
    from moe_serve.kernels.plugin.vllm_compat import load

    assert ah.install(PluginConfig()) == [] and ah.install(PluginConfig(decode_attention=True, mode="vllm")) == []
    impl_cls = load(ah.FLASH_IMPL)
    monkeypatch.setattr(impl_cls, "forward", impl_cls.forward)            # restored at teardown
    hook = ah.AttentionHook(logging.getLogger("t"))
    assert hook.install() == ["FlashAttentionImpl.forward"] and hook.install() == []
    assert impl_cls.forward.__wrapped__ is not None

    def broken() -> str:
        raise AssertionError("forward changed")
    monkeypatch.setattr(ah, "pin_flash_attention", broken)
    with caplog.at_level(logging.WARNING, logger="t"):
        assert ah.AttentionHook(logging.getLogger("t")).install() == []
    assert "does not match its pin" in caplog.text and "forward changed" in caplog.text


def test_the_plugin_installs_it_as_a_worker_step_only_when_switched_on() -> None:
    """The worker's HookPlan: a "decode attention" step with the setting on in optimized mode,
    from additional_config or the environment; none by default or in mode vllm."""
    from moe_serve.kernels.config import KEY
    from moe_serve.kernels.plugin.vllm_plugin import MoePlugin

    def steps(environ: dict[str, str], **given: object) -> list[str]:
        return [name for name, _ in MoePlugin(PluginConfig.from_vllm({KEY: given}, environ), None).kernel_hook_steps()]

    assert "decode attention" not in steps({})
    assert "decode attention" in steps({}, decode_attention=True)
    assert "decode attention" in steps({"MOE_SERVE_DECODE_ATTENTION": "1"})
    assert "decode attention" not in steps({}, decode_attention=True, mode="vllm")
