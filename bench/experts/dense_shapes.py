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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VOCAB_PADDING = 64                  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class DenseShape:
    """One dense weight of a decode step: [N, K] per rank, run `per_step` times a step."""

    name: str
    N: int
    K: int
    per_step: int

    @property
    def weight_bytes(self) -> int:  # bf16
        return 2 * self.N * self.K


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


def dense_shapes(cfg: dict[str, Any], tp: int = 1) -> list[DenseShape]:
    """The dense weights of a decode step on one of tp ranks (see the module doc)."""
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
        out += [DenseShape("qkv", (q + 2 * k) * head_dim, H, layers),
                DenseShape("o", H, q * head_dim, layers)]
    moe = _moe_layers(c, layers)
    inter = int(c.get("intermediate_size") or 0)
    if layers - moe and inter:
        out += [DenseShape("mlp_gate_up", 2 * inter // tp, H, layers - moe),
                DenseShape("mlp_down", H, inter // tp, layers - moe)]
    shared = int(c.get("shared_expert_intermediate_size") or 0) or \
        int(c.get("n_shared_experts") or 0) * int(c.get("moe_intermediate_size") or 0)
    if moe and shared:
        out += [DenseShape("shared_gate_up", 2 * shared // tp, H, moe),
                DenseShape("shared_down", H, shared // tp, moe)]
    vocab = -(-int(c["vocab_size"]) // VOCAB_PADDING) * VOCAB_PADDING
    out.append(DenseShape("lm_head", vocab // tp, H, 1))
    return out


_QWEN3_30B = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "decoder_sparse_step": 1}
_MIXTRAL_8X7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
                 "intermediate_size": 14336}
NAMED: dict[str, list[DenseShape]] = {   # the real models' shapes (Qwen3's own 151936 vocabulary)
    f"{name}/tp{tp}": dense_shapes(cfg, tp)
    for name, cfg in (("qwen3-30b-a3b", _QWEN3_30B), ("mixtral-8x7b", _MIXTRAL_8X7B)) for tp in (1, 8)}
DEFAULT_NAMED = ("qwen3-30b-a3b/tp1", "mixtral-8x7b/tp1")
SMOKE = {"tiny/tp1": [DenseShape("qkv", 48, 256, 2), DenseShape("o", 40, 512, 2)]}
