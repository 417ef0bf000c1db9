"""The embedded default model: a tiny Mixtral-style MoE with random weights.

Built once, deterministically (fixed seed), into a cache directory, with the Mixtral
sentencepiece tokenizer that ships inside `mistral_common`. Its text is meaningless;
the serving pipeline (tokenizer, attention, top-2 routed experts, sampler) is real.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Mistral-instruct style turns with Hermes-style tools: the tool list goes first, assistant tool
# calls render as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (what vLLM's `hermes`
# tool parser reads), tool results as <tool_response>...</tool_response>. `bos_token` is added by
# the template, so the rendered text is encoded without special tokens. Other roles (vLLM accepts
# custom ones) render as a user turn naming the role.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '[INST] <<SYS>> You may call functions. Signatures: <tools>' }}"
    "{% for tool in tools %}{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ {'name': f['name'], 'description': f['description'] or '',"
    " 'parameters': f['parameters'] or {}} | tojson }}"
    "{% endfor %}"
    "{{ '</tools> Call one as <tool_call>{\"name\": <name>, \"arguments\": <JSON object>}</tool_call>"
    " <</SYS>> [/INST]' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}"
    "{{ '[INST] <<SYS>> ' + message['content'] + ' <</SYS>> [/INST]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '[INST] <tool_response>' + message['content'] + '</tool_response> [/INST]' }}"
    "{% elif message['role'] != 'assistant' %}"
    "{{ '[INST] ' + message['role'] + ': ' + message['content'] + ' [/INST]' }}"
    "{% else %}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class TinyMixtralSpec:
    """Shape of the embedded model. Changing any field changes the cache key."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    seed: int = 1234
    format_version: int = 4  # 2: chat template renders tools and tool-call history

    def cache_key(self) -> str:
        return "tiny-mixtral-" + "-".join(str(v) for v in asdict(self).values())


def default_cache_dir() -> Path:
    """`$MOE_SERVE_CACHE` or `~/.cache/moe-serve`."""
    root = os.environ.get("MOE_SERVE_CACHE") or os.path.join(Path.home(), ".cache", "moe-serve")
    return Path(root)


def _tokenizer_model_path() -> Path:
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.is_file():
        raise FileNotFoundError(f"Mixtral tokenizer not found in mistral_common at {path}")
    return path


def _write_tokenizer(out_dir: Path) -> None:
    """Save the Mixtral sentencepiece model and let transformers convert it once."""
    from transformers import AutoTokenizer

    shutil.copyfile(_tokenizer_model_path(), out_dir / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "legacy": False,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    if len(tokenizer) < 32000 or not tokenizer.encode("hello world"):
        raise RuntimeError(f"tokenizer conversion failed: vocab {len(tokenizer)}")
    tokenizer.save_pretrained(str(out_dir))


def _write_weights(out_dir: Path, spec: TinyMixtralSpec) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_local_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def ensure_embedded_model(cache_dir: Path | None = None, spec: TinyMixtralSpec | None = None) -> Path:
    """Return the directory of the embedded model, building it on first use.

    The build writes into a temporary sibling and renames it into place, so an
    interrupted build never leaves a half-written model behind.
    """
    spec = spec or TinyMixtralSpec()
    target = (cache_dir or default_cache_dir()) / spec.cache_key()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building embedded model %s (one time, ~10 s)", target.name)
    print(f"[moe-serve] building embedded tiny Mixtral into {target} ...", flush=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        print("[moe-serve]   1/2 random bf16 weights (seed %d)" % spec.seed, flush=True)
        _write_weights(staging, spec)
        print("[moe-serve]   2/2 Mixtral tokenizer from mistral_common", flush=True)
        _write_tokenizer(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent builder winning
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"[moe-serve] embedded model ready: {target}", flush=True)
    return target


if __name__ == "__main__":
    print(ensure_embedded_model())
