"""service/tokenizer_cache.py on vLLM's real pooled tokenizer of the embedded model: the BPE cache
of the copy that encodes is bounded (malloc'd bytes stay flat), which it is not by default."""

from __future__ import annotations

import ctypes
import platform
import random

import pytest

from moe_serve.loadtest.prompts import prompt
from moe_serve.service.tokenizer_cache import _pool_members, bound_bpe_caches

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="measures with glibc mallinfo2")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use_mib() -> float:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().uordblks / 2 ** 20


def _growth_mib(tok, seed: int, n: int = 1500) -> float:
    """malloc'd MiB kept after encoding n unique 20-word prompts (short enough to be cached)."""
    rng = random.Random(seed)
    before = _malloc_in_use_mib()
    for _ in range(n):
        tok.encode(prompt(rng, 20))
    return _malloc_in_use_mib() - before


def _pooled_tokenizer():
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import maybe_make_thread_pool

    from moe_serve.service.embedded_model import ensure_embedded_model

    return maybe_make_thread_pool(AutoTokenizer.from_pretrained(str(ensure_embedded_model())))


def test_pool_members_are_found() -> None:
    members = list(_pool_members(_pooled_tokenizer()))
    assert len(members) >= 2  # vLLM's original + at least one deep copy


def test_bounded_cache_stops_the_growth() -> None:
    unbounded = _growth_mib(_pooled_tokenizer(), seed=1)
    tok = _pooled_tokenizer()
    assert bound_bpe_caches(tok, entries=16) >= 2
    bounded = _growth_mib(tok, seed=2)
    assert unbounded > 4.0, unbounded  # ~4.7 KB per cached prompt by default
    assert bounded < 1.0, bounded
