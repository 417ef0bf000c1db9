"""A model directory for dummy-weight benchmark runs: a config from bench/models plus the Mixtral tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

MODELS = Path(__file__).resolve().parent / "models"


def dummy_model_dir(name: str, out: Path, layers: int | None = None) -> Path:
    """out/models/NAME[-Ll] with bench/models/NAME/config.json (num_hidden_layers cut to `layers`)
    and the embedded model's tokenizer; vLLM then runs it with load_format=dummy."""
    src = MODELS / name / "config.json"
    if not src.is_file():
        raise SystemExit(f"no model config {src}; have: {', '.join(sorted(p.name for p in MODELS.iterdir()))}")
    d = out / "models" / (name if layers is None else f"{name}-{layers}l")
    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(src.read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    if not (d / "tokenizer.json").is_file():
        from service.embedded_model import _write_tokenizer  # the embedded model's tokenizer recipe

        _write_tokenizer(d)
    return d
