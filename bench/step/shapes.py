"""The per-layer shapes of a decode step that the fused pieces serve, read from a model's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepShapes:
    """One rank's decode-step shapes (TP 1 unless `tp` says otherwise).

    hidden: K of the QKV / gate GEMVs; qkv_rows: (Hq + 2 Hkv) * D; o_cols: Hq * D (K of o_proj);
    experts: the router's rows; vocab: the lm_head's rows."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rot_dim: int
    experts: int
    vocab: int
    eps: float
    rope_theta: float
    qk_norm: bool            # per-head q / k RMSNorm (Qwen3)
    tp: int = 1

    @property
    def qkv_rows(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def o_cols(self) -> int:
        return self.q_heads * self.head_dim


def step_shapes(model_dir: Path, tp: int = 1) -> StepShapes:
    """The shapes of bench/models/<name> (or any HF model dir) at tensor-parallel size tp: heads and
    the vocabulary split over the ranks as vLLM splits them (kv heads replicated below tp)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    hq = text["num_attention_heads"]
    hkv = text.get("num_key_value_heads", hq)
    d = text.get("head_dim") or text["hidden_size"] // hq
    if hq % tp:
        raise ValueError(f"{model_dir}: {hq} attention heads do not split over tp={tp}")
    rot = int(d * text.get("partial_rotary_factor", 1.0))
    return StepShapes(
        name=Path(model_dir).name, layers=text["num_hidden_layers"], hidden=text["hidden_size"],
        q_heads=hq // tp, kv_heads=max(1, hkv // tp), head_dim=d, rot_dim=rot - rot % 2,
        experts=text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0,
        vocab=-(-text["vocab_size"] // tp), eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(text.get("rope_theta", 10000.0)),
        qk_norm=text.get("model_type") in ("qwen3_moe", "qwen3", "qwen3_next"), tp=tp)
