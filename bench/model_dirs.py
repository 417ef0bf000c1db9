"""Model directories for dummy-weight benchmark runs: a config from bench/models plus a tokenizer
that covers the model's whole vocabulary.

The Mixtral models get the embedded model's tokenizer (Mixtral's own, 32,000 ids); every other
model gets a word-level tokenizer built here at its config's `vocab_size` V (no hub): ids 0-2 are
`<unk>`, `<s>`, `</s>` (the configs' bos and eos ids) and id i >= 3 is the word `w<i>`, so every id
decodes to a word that encodes back to that id, whatever V. It is built at run time into the
model dir (3.5 MB at V = 151,936), never committed. Its words hold no punctuation, so no
structured-output constraint (JSON) can be met with it: moe-serve's start-up warm-up logs its
structured-output request as failed; the yardstick sends token ids and plain completions only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MODELS = Path(__file__).resolve().parent / "models"
QUANTIZATION = {  # checkpoint-style quantization_config entries for dummy-weight runs
    "fp8-static": {"quant_method": "fp8", "activation_scheme": "static"},  # per-tensor W8A8
}
MIXTRAL_VOCAB = 32000          # the embedded model's (Mixtral's) tokenizer; every bench model carried it
SPECIALS = ("<unk>", "<s>", "</s>")   # ids 0, 1, 2 of the word-level tokenizer
WORD_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def model_config(name: str) -> dict[str, Any] | None:
    """bench/models/NAME/config.json, or None where there is no such model."""
    path = MODELS / name / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def config_sha(cfg: dict[str, Any]) -> str:
    """Hash of a model config without the writer's bookkeeping keys."""
    keep = {k: v for k, v in cfg.items() if k not in ("transformers_version", "_name_or_path")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def model_config_of_run(name: str, sha: str) -> dict[str, Any] | None:
    """The config a run of bench model `name` used, identified by its config_sha: today's
    config.json, or the same config at the Mixtral tokenizer's vocabulary (what every bench model
    carried before its real one); None where neither hashes to `sha`."""
    cfg = model_config(name)
    if cfg is None:
        return None
    for candidate in (cfg, {**cfg, "vocab_size": MIXTRAL_VOCAB}):
        if config_sha(candidate) == sha:
            return candidate
    return None


def write_word_tokenizer(out: Path, vocab: int) -> None:
    """tokenizer.json and tokenizer_config.json of the word-level tokenizer over `vocab` ids
    (module docstring) into `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if vocab <= len(SPECIALS):
        raise ValueError(f"vocab {vocab}: needs more ids than the {len(SPECIALS)} special ones")
    words = {**{s: i for i, s in enumerate(SPECIALS)}, **{f"w{i}": i for i in range(len(SPECIALS), vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIALS[0], "bos_token": SPECIALS[1],
              "eos_token": SPECIALS[2], "model_max_length": 1 << 20, "chat_template": WORD_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def decodable_ids(model_dir: Path, vocab: int) -> int:
    """How many ids from 0 the model dir's tokenizer decodes (its tokenizer.json's vocabulary
    and added tokens), at most `vocab`; `vocab` where there is no tokenizer.json to read."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return vocab
    tok = json.loads(path.read_text())
    known = tok["model"]["vocab"]
    ids = list(known.values()) if isinstance(known, dict) else list(range(len(known)))   # Unigram: a list
    ids += [t["id"] for t in tok.get("added_tokens", [])]
    present = set(ids)
    n = 0
    while n < vocab and n in present:
        n += 1
    return n


def dummy_model_dir(name: str, out: Path, layers: int | None = None,
                    quantization: str | None = None) -> Path:
    """out/models/NAME[-Ll][-QUANT] with bench/models/NAME/config.json (num_hidden_layers cut to
    `layers`, a QUANTIZATION entry as its quantization_config) and a tokenizer covering its
    vocabulary (module docstring); vLLM then runs it with load_format=dummy."""
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
    if decodable_ids(d, cfg["vocab_size"]) < cfg["vocab_size"] or not (d / "tokenizer_config.json").is_file():
        if cfg["vocab_size"] == MIXTRAL_VOCAB:
            from moe_serve.service.embedded_model import _write_tokenizer  # the embedded model's tokenizer recipe

            _write_tokenizer(d)
        else:
            write_word_tokenizer(d, cfg["vocab_size"])
    return d
