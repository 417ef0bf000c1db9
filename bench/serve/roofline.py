"""The byte floor of a decode step: bytes one step must read on one TP rank, weights and KV cache.

A decode step reads every weight it multiplies by, once, whatever the batch: attention
(q/k/v/o, or DeepSeek's MLA projections), norms, the router, the experts its tokens are routed
to (gate/up/down each), shared experts, dense MLP layers (DeepSeek's first layers, Qwen3-MoE's
`mlp_only_layers`), lm_head, and one embedding row per token (`weight_parts`); and each
sequence's KV cache, once per layer (`kv_cache_bytes`: k and v per KV head on the rank, MLA's
compressed latent and rope key for DeepSeek). Under tensor parallelism a rank holds 1/TP of every
sharded matrix and all of a replicated one (router, norms, MLA's down-projections; k/v when there
are fewer KV heads than ranks, one head per rank as vLLM does).

Experts hit: k per token at batch 1 (exact); at batch b the expected number of distinct experts
under uniform independent routing, E * (1 - (1 - k/E)^b): what a model's traffic reads when its
router spreads tokens evenly (vLLM's `uniform_random` routing simulation). Dummy weights crowd a
batch's tokens onto fewer experts and read less.

The floor step time is these bytes over a copy ceiling in bytes read+written per second (a large
device-to-device copy: bench/serve/host.py measures it on the GPU).

Supported families (config.json `model_type`): mixtral, qwen3_moe, deepseek_v2, deepseek_v3.
FP8 checkpoints (`quantization_config.quant_method` "fp8" or compressed-tensors) read one byte per
element of the quantized linear layers (attention, experts, dense MLP); the router, norms,
embedding and lm_head stay in the model dtype, as vLLM loads them. The KV cache is in the model
dtype (vLLM's default `kv_cache_dtype=auto`).
"""
from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def _linear_bytes(cfg: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes per element of the quantizable linear layers."""
    quant = cfg.get("quantization_config")
    if not quant:
        return dtype_bytes
    if quant.get("quant_method") in ("fp8", "compressed-tensors"):
        return 1                     # compressed-tensors: the FP8 formats the bench models carry
    raise ValueError(f"roofline: unsupported quantization {quant.get('quant_method')!r}")


def expected_experts_hit(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a step of `batch` tokens reads: k at batch 1, else the expectation under
    uniform independent routing."""
    if batch == 1:
        return float(top_k)
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def _attention(cfg: dict[str, Any], tp: int, lin: int, dt: int) -> float:
    """Bytes of one layer's attention weights on one rank."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:                                  # DeepSeek MLA
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        kv_rank, q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        if q_rank:
            q = h * q_rank * lin + q_rank * dt + q_rank * heads * qk * lin / tp   # q_a, its norm, q_b
        else:
            q = h * heads * qk * lin / tp
        kv_a = h * (kv_rank + cfg["qk_rope_head_dim"]) * lin + kv_rank * dt         # kv_a_proj, its norm
        kv_b = kv_rank * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) * lin / tp
        o = heads * cfg["v_head_dim"] * h * lin / tp
        return q + kv_a + kv_b + o
    hd = cfg.get("head_dim") or h // heads
    kv_heads_rank = max(1, cfg.get("num_key_value_heads", heads) // tp)
    qo = 2 * h * heads * hd * lin / tp
    kv = 2 * h * kv_heads_rank * hd * lin
    qk_norm = 2 * hd * dt if cfg["model_type"] == "qwen3_moe" else 0
    return qo + kv + qk_norm


def _moe_layers(cfg: dict[str, Any]) -> list[bool]:
    """Per layer: True for a MoE layer, False for a dense MLP layer."""
    n, t = cfg["num_hidden_layers"], cfg["model_type"]
    if t == "mixtral":
        return [True] * n
    if t == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        return [i not in dense and (i + 1) % step == 0 for i in range(n)]
    first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    return [i >= first and i % freq == 0 for i in range(n)]


def decode_step_bytes(cfg: dict[str, Any], tp: int = 1, batch: int = 1) -> dict[str, float]:
    """Bytes one decode step of `batch` tokens reads on one of `tp` ranks, by part, and "total"."""
    t = cfg.get("model_type")
    if t not in FAMILIES:
        raise ValueError(f"roofline: model_type {t!r} is not one of {FAMILIES}")
    dt = DTYPE_BYTES[cfg.get("torch_dtype", "bfloat16")]
    lin = _linear_bytes(cfg, dt)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
    top_k = cfg["num_experts_per_tok"]
    moe_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    layers = _moe_layers(cfg)
    n_moe = sum(layers)
    shared = cfg.get("n_shared_experts") or 0
    parts = {
        "attention": len(layers) * _attention(cfg, tp, lin, dt),
        "norms": (2 * len(layers) + 1) * h * dt,
        "router": n_moe * experts * h * dt,
        "experts": n_moe * expected_experts_hit(experts, top_k, batch) * 3 * h * moe_inter * lin / tp,
        "shared_experts": n_moe * shared * 3 * h * moe_inter * lin / tp,
        "dense_mlp": (len(layers) - n_moe) * 3 * h * cfg["intermediate_size"] * lin / tp,
        "lm_head": vocab * h * dt / tp,
        "embedding_rows": batch * h * dt,
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_cache_bytes(cfg: dict[str, Any], tp: int, batch: int, context: float) -> float:
    """Bytes of KV cache one decode step reads on one rank: `batch` sequences of `context` cached
    tokens each, every layer's k and v (MLA: its latent and rope key, replicated on every rank)."""
    dt = DTYPE_BYTES[cfg.get("torch_dtype", "bfloat16")]
    if "kv_lora_rank" in cfg:
        per_token_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dt
    else:
        heads = cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        per_token_layer = 2 * max(1, cfg.get("num_key_value_heads", heads) // tp) * hd * dt
    return batch * context * cfg["num_hidden_layers"] * per_token_layer


def byte_floor(cfg: dict[str, Any], tp: int, batch: int, context: float) -> dict[str, float]:
    """Bytes one decode step reads on one rank: the weight parts, "kv_cache", and "total"."""
    parts = decode_step_bytes(cfg, tp, batch)
    parts["kv_cache"] = kv_cache_bytes(cfg, tp, batch, context)
    parts["total"] += parts["kv_cache"]
    return parts

