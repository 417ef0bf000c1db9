"""Seeded random prompts made of common English words (no datasets needed offline).

Most of these words are one token in the Mixtral/Llama sentencepiece vocabulary, so a
prompt of `n` words is about `n` tokens; the exact count comes back in `usage`.
"""

from __future__ import annotations

import random

WORDS = tuple("""
the of and to in is was for on that with as by at from his her they which be this are have
had not but one all were when there can an their more if will time no would about out many
them then so some these two has like other into make first been its who now people my made
over did down only way find use may water long little very after words called just where
most know get through back much before go good new write our used me man too any day same
right look think also around another came come work three word must because does part even
place well such here take why things help put years different away again off went old
number great tell men say small every found still between name should home big give air
line set own under read last never us left end along while might next sound below saw
something thought both few those always looked show large often together asked house world
going want school important until form food keep children feet land side without boy once
animals life enough took sometimes four head above kind began almost live page got earth
need far hand high year mother light parts country father let night following picture
being study second eyes soon times story boys since white days ever paper hard near
sentence better best across during today others however sure means knew its try told young
miles sun ways thing whole hear example heard several change answer room sea against top
turned learn point city play toward five using himself usually money seen car morning
""".split())


def words(rng: random.Random, n: int) -> str:
    """`n` words drawn with replacement from WORDS."""
    return " ".join(rng.choices(WORDS, k=max(1, n)))


def prompt(rng: random.Random, n_words: int, instruction: str = "") -> str:
    """An instruction (optional) followed by `n_words` random words."""
    body = words(rng, n_words)
    return f"{instruction} {body}" if instruction else body
