"""The plugin's decode-attention hook: a decode batch's attention on our one-launch paged decode
kernel (kernels/attention/decode.py) instead of vLLM's FlashAttention, behind the
decode_attention setting (off by default until the yardstick shows its gain).

Where: ``FlashAttentionImpl.forward`` (vLLM's FLASH_ATTN backend, the default on Hopper), wrapped
on the class (pinned by `pin_flash_attention`, checked when the hook installs: a failed pin leaves
vLLM's attention in place and says why). vLLM's supported point for attention, a CUSTOM backend
(`register_backend`), is chosen by the engine's attention_config, which a plugin cannot set under
`vllm serve`; the wrapper keeps FlashAttention's own metadata builder, cache layout and every
other path, and takes only the calls our kernel computes exactly:

- the layer: a decoder layer without ALiBi, logit soft-capping, a sliding window, attention sinks
  or decode context parallelism, its KV cache in the model's dtype (kv_cache_dtype "auto"): its
  plan (`layer_plan.attention_plan`), looked up once per layer and logged once per reason;
- the call: metadata present (not the profile run), one query token per sequence
  (max_query_len 1), no cascade, per-batch sliding window, per-sequence causal mask, multimodal
  prefix or R-SWA ranges, no fused output quantization, bf16 / fp16 (`call_unsupported`).

Everything else runs vLLM's forward unchanged. The cache (written by vLLM's own KV-cache update
before forward) is read in FlashAttention's layout, K and V halves of [blocks, Hkv, block_size,
2 D] viewed as vLLM views them. With full CUDA graphs the captured decode graphs hold our launch;
padded sequences (length 0) write nothing. Warm-up: each (dtype, Hq, Hkv, D) the profile run
showed is compiled before the graphs are captured (`warm_pending`), so serving compiles nothing.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.plugin.layer_plan import attention_plan
from moe_serve.kernels.plugin.vllm_compat import load, wrap_method

FLASH_IMPL = ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl")
FLASH_BACKEND = ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend")
FORWARD_PARAMS = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
                  "output_block_scale")
DTYPES = (torch.bfloat16, torch.float16)
WHY = "_moe_serve_decode_attention"           # per impl: why not (None: taken), decided once
ShapeKey = tuple[str, torch.dtype, int, int, int]   # device, dtype, Hq, Hkv, D


def pin_flash_attention() -> str:
    """What the hook relies on in vLLM's FlashAttentionImpl (0.26 and 0.32): forward's parameters;
    the cache's K / V views; seq_lens, block_table and self.scale as FlashAttention's decode
    inputs; the features layer_plan.attention_plan reads set in __init__; the KV-cache update
    outside forward."""
    impl = load(FLASH_IMPL)
    assert tuple(inspect.signature(inspect.unwrap(impl.forward)).parameters) == FORWARD_PARAMS
    src = inspect.getsource(inspect.unwrap(impl.forward))
    for line in ("key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)",
                 "seqused_k = attn_metadata.seq_lens", "block_table = attn_metadata.block_table",
                 "softmax_scale=self.scale", "max_seqlen_q = attn_metadata.max_query_len"):
        assert line in src, line
    init = inspect.getsource(impl.__init__)
    for attr in ("alibi_slopes", "sliding_window", "logits_soft_cap", "sinks", "kv_cache_dtype", "attn_type",
                 "head_size", "scale", "num_kv_heads"):
        assert f"self.{attr} = " in init, attr
    assert load(FLASH_BACKEND).forward_includes_kv_cache_update is False
    return "FlashAttentionImpl.forward's parameters, cache views, decode inputs and features"


def call_unsupported(impl: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: torch.Tensor | None,
                     quantized_output: bool) -> str | None:
    """Why this call is not a plain decode batch our kernel takes; None: it is."""
    if md is None:
        return "profile run"
    if quantized_output:
        return "fused output quantization"
    if md.max_query_len != 1:
        return "not a decode batch"
    if getattr(md, "use_cascade", False) or getattr(md, "sliding_window", None) is not None:
        return "cascade or per-batch sliding window"
    if getattr(md, "causal", True) is not True:
        return "per-sequence causal mask"
    if any(getattr(md, name, None) is not None for name in
           ("mm_prefix_range_tensor", "mm_prefix_query_range_tensor", "rswa_prefix_lens")):
        return "multimodal prefix or R-SWA ranges"
    if query.dtype not in DTYPES or kv_cache.dtype != query.dtype:
        return f"dtype {query.dtype} / cache {kv_cache.dtype}"
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * impl.head_size or output is None or output.dim() != 3:
        return "cache or output layout"
    return None


class AttentionHook:
    """The forward wrapper, the shapes seen and the reasons logged, for one process."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.pending: set[ShapeKey] = set()
        self.warmed: set[ShapeKey] = set()
        self.logged: set[str] = set()

    def install(self) -> list[str]:
        """Check the pin, then wrap FlashAttentionImpl.forward (once); the names of what was wrapped
        ([] with the reason logged where the pin fails)."""
        try:
            pin_flash_attention()
        except Exception as exc:  # noqa: BLE001 - a failed pin leaves vLLM's attention in place
            self.logger.warning("moe-serve decode attention: not installed, vLLM's FlashAttentionImpl does not "
                                "match its pin: %r", exc)
            return []
        return ["FlashAttentionImpl.forward"] if wrap_method(load(FLASH_IMPL), "forward", self.forward) else []

    def forward(self, orig: Callable) -> Callable:
        """make() for FlashAttentionImpl.forward (FORWARD_PARAMS)."""
        from moe_serve.kernels.attention.decode import decode_attention

        def forward(impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor | None = None,
                    output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None):
            why = impl.__dict__.get(WHY, "")
            if why == "":
                why = self._decide(impl)
            if why is None:
                if attn_metadata is None and query.dtype in DTYPES:                       # the profile run
                    self.pending.add((str(query.device), query.dtype, query.shape[1], impl.num_kv_heads,
                                      impl.head_size))
                elif call_unsupported(impl, query, kv_cache, attn_metadata, output,
                                      output_scale is not None or output_block_scale is not None) is None:
                    B = attn_metadata.seq_lens.shape[0]
                    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
                    decode_attention(query[:B], key_cache, value_cache, attn_metadata.block_table,
                                     attn_metadata.seq_lens, impl.scale, out=output[:B])
                    return output
            return orig(impl, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                        output_block_scale)
        return forward

    def _decide(self, impl: Any) -> str | None:
        why = attention_plan(impl)
        setattr(impl, WHY, why)
        if why is not None and why not in self.logged:
            self.logged.add(why)
            self.logger.info("moe-serve decode attention: vLLM's FlashAttention serves layers with %s", why)
        return why

    def warm_pending(self) -> int:
        """Compile the kernel for each shape the profile run showed (one launch on a one-token
        context: the batch and split count are not specialized); how many were compiled."""
        from moe_serve.kernels.attention.decode import decode_attention

        done = 0
        for key in sorted(self.pending - self.warmed, key=str):
            dev, dtype, Hq, Hkv, D = key
            kv = torch.zeros(2, 16, Hkv, 2 * D, dtype=dtype, device=dev)    # [blocks, block_size, Hkv, 2 D]: NHD
            key_cache, value_cache = kv.split(D, dim=-1)
            q = torch.zeros(1, Hq, D, dtype=dtype, device=dev)
            decode_attention(q, key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32, device=dev),
                             torch.ones(1, dtype=torch.int32, device=dev), 1.0)
            self.warmed.add(key)
            self.logger.info("moe-serve decode attention: compiled for %s %s, %d + %d heads x %d", dev, dtype, Hq,
                             Hkv, D)
            done += 1
        return done


_hook: AttentionHook | None = None


def install(plugin_config: PluginConfig, logger: logging.Logger | None = None) -> list[str]:
    """With the decode_attention setting on in optimized mode: the hook (once per process); the
    names of what was wrapped ([] when off or refused)."""
    global _hook
    if plugin_config.mode != "optimized" or not plugin_config.decode_attention:
        return []
    if _hook is None:
        _hook = AttentionHook(logger or logging.getLogger(__name__))
    return _hook.install()


def warm_pending() -> int:
    """AttentionHook.warm_pending of the installed hook (0 when none is)."""
    return _hook.warm_pending() if _hook is not None else 0
