"""Bound the BPE word cache of the tokenizers the API process encodes prompts with.

HF `tokenizers` caches the merges of every input "word" shorter than 256 bytes, up to 10,000
entries per BPE model. Llama/Mistral-style tokenizers have no pre-tokenizer, so a whole short
prompt is one word: each unique short prompt stays cached, ~4.7 KB each (2026-11-29: 2,000 unique
20-word prompts +9.4 MiB of malloc'd memory; 40-word prompts are too long to be cached, +0.0). In the
soak that was the API process's steady RSS growth (memray: 72 % of what a window left alive, in
BPE `merge_word`). Serving sees few repeats of a whole prompt, so a small cache loses little.
vLLM wraps its tokenizer in a pool of deep copies (vllm/tokenizers/hf.py, maybe_make_thread_pool);
the copies are reached through the pool's closure, and every BPE model found is resized.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

BPE_CACHE_ENTRIES = 1024  # at most ~5 MB of cached whole-prompt merges per tokenizer copy


def _pool_members(tokenizer: Any) -> Iterator[Any]:
    """The original and the pooled copies behind a vLLM TokenizerPool (nothing for other objects)."""
    borrow = getattr(getattr(type(tokenizer), "encode", None), "__closure__", None) or ()
    for cell in borrow:
        inner = getattr(cell.cell_contents, "__wrapped__", None)  # the @contextmanager function
        if inner is None or not inner.__closure__:
            continue
        free = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
        if "og_tokenizer" in free:
            yield free["og_tokenizer"]
        pool = free.get("tokenizer_pool")
        if pool is not None:
            yield from list(pool.queue)


def bound_bpe_caches(tokenizer: Any, entries: int = BPE_CACHE_ENTRIES) -> int:
    """Resize the BPE cache behind `tokenizer` and behind any pooled copies to `entries`; returns
    how many tokenizer objects had one (two objects may share one Rust model)."""
    resized = 0
    for tok in (tokenizer, *_pool_members(tokenizer)):
        model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
        if hasattr(model, "_resize_cache"):
            model._resize_cache(entries)
            resized += 1
    return resized
