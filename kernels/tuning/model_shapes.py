"""The MoE layer shapes one tensor-parallel rank runs, read from a model's HF config.json.

No weights are loaded. Field names differ per architecture family; each family lists where
its expert count, per-expert intermediate size, hidden size and top-k live. A config that
matches no family is an error that names the fields it looked for.
"""
from __future__ import annotations

import json
import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.moe import quant_format

EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
INTERMEDIATE = ("moe_intermediate_size", "intermediate_size", "ffn_hidden_size")
HIDDEN = ("hidden_size", "d_model")
TOPK = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "top_k")
NESTED = ("text_config", "ffn_config", "llm_config", "language_config")
UNSUPPORTED_ACTIVATION = {"GptOssForCausalLM": "swigluoai with biases"}


class ModelConfigError(ValueError):
    """config.json has no MoE layer our kernels can describe."""


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer's per-rank shape: E experts, N per-rank intermediate, K hidden."""

    name: str
    E: int
    N: int
    K: int
    topk: int
    dtype: str                         # kernels.moe.quant_format key: 'bf16' | 'fp16' | 'fp8' | ...
    layers: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.E, self.N, self.K, self.topk


def model_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The arguments every command about a model's MoE shapes takes: --model, -tp, --quantization."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local HF model directory (config.json)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--quantization", choices=["fp8", "compressed-tensors"], default=None,
                    help="vLLM's --quantization: the method whose format to use (default: the "
                         "checkpoint's quantization_config; 'fp8' with no such config: vLLM's "
                         "online per-tensor FP8)")
    return ap


def _find(cfgs: list[dict[str, Any]], names: tuple[str, ...]) -> Any:
    for c in cfgs:
        for n in names:
            if isinstance(c.get(n), int) and c[n] > 0:
                return c[n]
    return None


def read_config(model: str | Path) -> dict[str, Any]:
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ModelConfigError(f"no config.json at {path}")
    return json.loads(path.read_text())


def moe_shapes(cfg: dict[str, Any], tp: int = 1, quantization: str | None = None,
               name: str = "model") -> list[MoEShape]:
    """The distinct MoE shapes of one rank at tensor-parallel size tp (empty: not an MoE)."""
    layers = [cfg] + [cfg[k] for k in NESTED if isinstance(cfg.get(k), dict)]
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch in UNSUPPORTED_ACTIVATION:
        raise ModelConfigError(f"{arch}: its expert activation ({UNSUPPORTED_ACTIVATION[arch]}) "
                               f"is not SiLU-and-mul; vLLM's kernels serve it")
    E, N, K, topk = (_find(layers, f) for f in (EXPERTS, INTERMEDIATE, HIDDEN, TOPK))
    if E is None and topk is None:
        return []
    missing = [f"one of {list(f)}" for v, f in ((E, EXPERTS), (N, INTERMEDIATE), (K, HIDDEN),
                                               (topk, TOPK)) if v is None]
    if missing:
        raise ModelConfigError(f"{arch}: config.json lacks {', '.join(missing)} "
                               f"(needed: experts, per-expert intermediate size, hidden size, top-k)")
    if N % tp:
        raise ModelConfigError(f"intermediate size {N} is not divisible by tensor-parallel size {tp}")
    try:
        fmt = quant_format.of_checkpoint(_find_dict(layers, "quantization_config"), quantization)
    except quant_format.FormatError as e:
        raise ModelConfigError(str(e)) from e
    dtype = fmt or {"float16": "fp16"}.get(
        str(_find_str(layers, "torch_dtype") or _find_str(layers, "dtype") or "bfloat16"), "bf16")
    n_layers = _find(layers, ("num_hidden_layers", "n_layers", "num_layers")) or 1
    return [MoEShape(name=f"{name}/TP{tp}", E=E, N=N // tp, K=K, topk=min(topk, E),
                     dtype=dtype, layers=n_layers)]


def _find_dict(cfgs: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    for c in cfgs:
        if isinstance(c.get(key), dict):
            return c[key]
    return None


def _find_str(cfgs: list[dict[str, Any]], key: str) -> str | None:
    for c in cfgs:
        if isinstance(c.get(key), str):
            return c[key]
    return None
