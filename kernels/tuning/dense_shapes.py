"""The dense GEMMs of one decode step on one tensor-parallel rank, as [N, K] weights (nn.Linear's
layout: N output rows of K) with how many of each a step runs, from a model's config.json or by
name.

Per rank at TP = tp, as vLLM shards them: the fused QKV projection ((heads / tp + 2 x max(1,
kv_heads / tp)) x head_dim rows: KV heads are replicated when there are fewer than ranks), the
output projection (K = heads / tp x head_dim), the dense MLP of the layers that have one (fused
gate and up, down), the shared experts' MLP of the MoE layers that have them, and the lm_head (the
vocabulary padded to a multiple of 64, split over the ranks). Not listed: MLA attention's
projections (DeepSeek: models with kv_lora_rank get the rest), the routers' gates (served by the
fused router at decode).

Each shape has its weight format (moe_serve.kernels.dense.configs dtype key): bf16, or for an FP8
checkpoint (quantization_config, or vLLM's --quantization) its FP8 format for every linear layer
(fp8_tensor: quant_method fp8 without blocks; fp8_block{bn}x{bk}: with weight_block_size;
fp8_channel / fp8_tensor: compressed-tensors channel / tensor weights) and bf16 for the lm_head
(vLLM builds no FP8 lm_head through these methods).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_serve.kernels.dense import configs

VOCAB_PADDING = 64                  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class DenseShape:
    """One dense weight of a decode step: [N, K] per rank, run `per_step` times a step."""

    name: str
    N: int
    K: int
    per_step: int
    fmt: str = "bf16"

    @property
    def weight_bytes(self) -> int:
        """Bytes one call streams: the weights, and for FP8 their fp32 scales."""
        if not configs.is_fp8(self.fmt):
            return 2 * self.N * self.K
        block = configs.block_of(self.fmt)
        scales = (-(-self.N // block[0]) * -(-self.K // block[1]) if block else
                  self.N if self.fmt == configs.fp8_key(None, True) else 1)
        return self.N * self.K + 4 * scales


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def _moe_layers(c: dict[str, Any], layers: int) -> int:
    """How many of the layers are MoE layers (the others have a dense MLP)."""
    if not any(c.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        return 0
    if c.get("first_k_dense_replace") is not None:                       # DeepSeek
        return layers - int(c["first_k_dense_replace"])
    step = int(c.get("decoder_sparse_step") or 1)                       # Qwen2/3-MoE
    only = set(c.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)


def linear_format(cfg: dict[str, Any], quantization: str | None = None) -> str:
    """The weight format of a checkpoint's linear layers (see the module doc)."""
    qc = cfg.get("quantization_config") or {}
    method = quantization or qc.get("quant_method")
    if method == "fp8":
        wbs = qc.get("weight_block_size")
        return configs.fp8_key(tuple(wbs) if wbs else None)
    if method == "compressed-tensors":
        w = next(iter((qc.get("config_groups") or {}).values()), {}).get("weights") or {}
        if w.get("type") == "float" and w.get("num_bits") == 8:
            bs = w.get("block_structure")
            return configs.fp8_key(tuple(bs) if w.get("strategy") == "block" else None, w.get("strategy") == "channel")
    if method is not None:
        raise ValueError(f"quantization {method!r}: the dense bench times bf16 and FP8 linear layers")
    return "bf16"


def dense_shapes(cfg: dict[str, Any], tp: int = 1, quantization: str | None = None) -> list[DenseShape]:
    """The dense weights of a decode step on one of tp ranks (see the module doc)."""
    fmt = linear_format(cfg, quantization)
    c = _text_config(cfg)
    H, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or H // heads)
    if heads % tp:
        raise ValueError(f"{heads} attention heads do not split over {tp} ranks")
    out: list[DenseShape] = []
    if not c.get("kv_lora_rank"):
        q, k = heads // tp, max(1, kv // tp)
        out += [DenseShape("qkv", (q + 2 * k) * head_dim, H, layers, fmt),
                DenseShape("o", H, q * head_dim, layers, fmt)]
    moe = _moe_layers(c, layers)
    inter = int(c.get("intermediate_size") or 0)
    if layers - moe and inter:
        out += [DenseShape("mlp_gate_up", 2 * inter // tp, H, layers - moe, fmt),
                DenseShape("mlp_down", H, inter // tp, layers - moe, fmt)]
    shared = int(c.get("shared_expert_intermediate_size") or 0) or \
        int(c.get("n_shared_experts") or 0) * int(c.get("moe_intermediate_size") or 0)
    if moe and shared:
        out += [DenseShape("shared_gate_up", 2 * shared // tp, H, moe, fmt),
                DenseShape("shared_down", H, shared // tp, moe, fmt)]
    vocab = -(-int(c["vocab_size"]) // VOCAB_PADDING) * VOCAB_PADDING
    out.append(DenseShape("lm_head", vocab // tp, H, 1))
    return out


_QWEN3_30B = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "decoder_sparse_step": 1}
_MIXTRAL_8X7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
                 "intermediate_size": 14336}
_FP8 = {"fp8-block": {"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8": {"quant_method": "fp8"},
        "fp8-dynamic": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
            "type": "float", "num_bits": 8, "strategy": "channel"}}}}}
NAMED: dict[str, list[DenseShape]] = {   # the real models' shapes (Qwen3's own 151936 vocabulary)
    f"{name}/tp{tp}": dense_shapes(cfg, tp)
    for name, cfg in (("qwen3-30b-a3b", _QWEN3_30B), ("mixtral-8x7b", _MIXTRAL_8X7B)) for tp in (1, 8)}
NAMED.update({f"qwen3-30b-a3b-{q}/tp{tp}": [s for s in dense_shapes({**_QWEN3_30B, "quantization_config": qc}, tp)
                                             if s.fmt != "bf16"]                # its bf16 lm_head: above
              for q, qc in _FP8.items() for tp in (1, 8)})
DEFAULT_NAMED = ("qwen3-30b-a3b/tp1", "mixtral-8x7b/tp1", "qwen3-30b-a3b-fp8-block/tp1", "qwen3-30b-a3b-fp8/tp1",
                 "qwen3-30b-a3b-fp8-dynamic/tp1")
SMOKE = {"tiny/tp1": [DenseShape("qkv", 48, 256, 2), DenseShape("o", 40, 512, 2)],
         "tiny-fp8/tp1": [DenseShape("qkv", 40, 272, 2, configs.fp8_key((16, 128))),
                          DenseShape("o", 24, 256, 2, configs.fp8_key(None, True))]}
