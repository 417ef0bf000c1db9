"""Model directories for dummy-weight benchmark runs: a config from bench/models plus the Mixtral tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MODELS = Path(__file__).resolve().parent / "models"
QUANTIZATION = {  # checkpoint-style quantization_config entries for dummy-weight runs
    "fp8-static": {"quant_method": "fp8", "activation_scheme": "static"},  # per-tensor W8A8
}


def model_config(name: str) -> dict[str, Any] | None:
    """bench/models/NAME/config.json, or None where there is no such model."""
    path = MODELS / name / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def config_sha(cfg: dict[str, Any]) -> str:
    """Hash of a model config without the writer's bookkeeping keys."""
    keep = {k: v for k, v in cfg.items() if k not in ("transformers_version", "_name_or_path")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def dummy_model_dir(name: str, out: Path, layers: int | None = None,
                    quantization: str | None = None) -> Path:
    """out/models/NAME[-Ll][-QUANT] with bench/models/NAME/config.json (num_hidden_layers cut to
    `layers`, a QUANTIZATION entry as its quantization_config) and the embedded model's
    tokenizer; vLLM then runs it with load_format=dummy."""
    src = MODELS / name / "config.json"
    if not src.is_file():
        raise SystemExit(f"no model config {src}; have: {', '.join(sorted(p.name for p in MODELS.iterdir()))}")
    suffix = ("" if layers is None else f"-{layers}l") + ("" if quantization is None else f"-{quantization}")
    d = out / "models" / f"{name}{suffix}"
    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(src.read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if quantization is not None:
        cfg["quantization_config"] = QUANTIZATION[quantization]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    if not (d / "tokenizer.json").is_file():
        from service.embedded_model import _write_tokenizer  # the embedded model's tokenizer recipe

        _write_tokenizer(d)
    return d
