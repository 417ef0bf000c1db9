"""The MoE layer shapes one tensor-parallel rank runs, read from a model's HF config.json.

No weights are loaded. Field names differ per architecture family; each family lists where
its expert count, per-expert intermediate size, hidden size and top-k live. A config that
matches no family is an error that names the fields it looked for. Some families give the
expert count, intermediate size or top-k as a list: one value per layer (0 experts: a dense
layer), or one per expert group applied to every layer; each distinct combination is one shape
with the number of layers that run it.
"""
from __future__ import annotations

import json
import argparse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_serve.kernels.moe import quant_format

EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
INTERMEDIATE = ("moe_intermediate_size", "intermediate_size", "ffn_hidden_size")
HIDDEN = ("hidden_size", "d_model")
TOPK = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "moe_topk", "moe_k", "top_k")
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
    dtype: str                         # moe_serve.kernels.moe.quant_format key: 'bf16' | 'fp16' | 'fp8' | ...
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


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _find(cfgs: list[dict[str, Any]], names: tuple[str, ...]) -> Any:
    for c in cfgs:
        for n in names:
            if _is_count(c.get(n)) and c[n] > 0:
                return c[n]
    return None


def _find_moe(cfgs: list[dict[str, Any]], names: tuple[str, ...]) -> tuple[str, int | list[int]] | None:
    """(field, value) like _find, where the value may also be a non-empty list of counts >= 0
    (one per layer or per expert group)."""
    for c in cfgs:
        for n in names:
            value = c.get(n)
            if _is_count(value) and value > 0:
                return n, value
            if isinstance(value, list) and value and all(_is_count(v) and v >= 0 for v in value):
                return n, value
    return None


def _layer_shapes(fields: list[tuple[str, int | list[int]]], n_layers: int) -> Counter[tuple[int, int, int]]:
    """{(E, N, topk): layers} from the MoE fields [(name, count or list)] in that order. A list as long as the
    model has layers gives one value per layer; another length, one per expert group, each run
    by every layer. Entries with a 0 (a dense layer, no experts) are skipped."""
    lists = {name: v for name, v in fields if isinstance(v, list)}
    lengths = {len(v) for v in lists.values()}
    if len(lengths) > 1:
        raise ModelConfigError("config.json gives per-layer MoE fields of different lengths: "
                               + ", ".join(f"{name} ({len(v)})" for name, v in lists.items()))
    length = lengths.pop() if lengths else 1
    layers_per_entry = 1 if lists and length == n_layers else n_layers
    counts: Counter[tuple[int, int, int]] = Counter()
    for i in range(length):
        row = tuple(v[i] if isinstance(v, list) else v for _, v in fields)
        if all(row):
            counts[row] += layers_per_entry  # type: ignore[index]
    return counts


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
    found = [_find_moe(layers, f) for f in (EXPERTS, INTERMEDIATE, TOPK)]
    E, N, topk = (None if f is None else f[1] for f in found)
    K = _find(layers, HIDDEN)
    if E is None and topk is None:
        return []
    missing = [f"one of {list(f)}" for v, f in ((E, EXPERTS), (N, INTERMEDIATE), (K, HIDDEN),
                                               (topk, TOPK)) if v is None]
    if missing:
        raise ModelConfigError(f"{arch}: config.json lacks {', '.join(missing)} "
                               f"(needed: experts, per-expert intermediate size, hidden size, top-k)")
    try:
        fmt = quant_format.of_checkpoint(_find_dict(layers, "quantization_config"), quantization)
    except quant_format.FormatError as e:
        raise ModelConfigError(str(e)) from e
    dtype = fmt or {"float16": "fp16"}.get(
        str(_find_str(layers, "torch_dtype") or _find_str(layers, "dtype") or "bfloat16"), "bf16")
    n_layers = _find(layers, ("num_hidden_layers", "n_layers", "num_layers")) or 1
    counts = _layer_shapes(found, n_layers)  # type: ignore[arg-type]  # none is None here
    if not counts:
        return []  # every layer dense
    for _, n, _ in counts:
        if n % tp:
            raise ModelConfigError(f"intermediate size {n} is not divisible by tensor-parallel size {tp}")
    several = len(counts) > 1
    return [MoEShape(name=f"{name}/TP{tp}" + (f"/E{e}-N{n}-top{k}" if several else ""), E=e, N=n // tp, K=K,
                     topk=min(k, e), dtype=dtype, layers=count)
            for (e, n, k), count in sorted(counts.items())]


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
