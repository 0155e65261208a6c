"""Deterministic prompt text of about a given number of tokens, for chat workloads (which send
text, not token ids).

Text is common English words drawn from a seeded :class:`random.Random`; its length is fitted
to the server's tokenizer by counting tokens with ``count`` (the model's tokenizer, as
``kvoffload serve`` encodes prompts): the longest run of drawn words whose count is at most the
target, so a text is at most one word's tokens short of it (byte-level presets: at most one word
of bytes). The same ``(seed, n)`` always gives the same text.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["WORDS", "words_of_tokens"]

_WORD_TEXT = (
    "the of and to in is was for on are with as by at be this have from or one had not but what "
    "all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no "
    "make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know get through back much go good new "
    "write our used me man day too any same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet "
    "land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let "
    "night following picture being study second eyes soon times story boys since white days "
    "ever paper hard near sentence better best across during today others however sure means "
    "knew its try told young miles sun ways thing whole hear example heard several change "
    "answer room sea against top turned learn point city play toward five using himself usually"
)
#: The words drawn from: short, common, mostly one token each in BPE vocabularies.
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))


def words_of_tokens(count: Callable[[str], int], n: int, seed: str) -> str:
    """Text of at most ``n`` tokens by ``count`` and as close to it as whole words allow
    (``""`` for ``n`` 0), drawn from :data:`WORDS` with ``random.Random(seed)``."""
    if n <= 0:
        return ""
    rng = random.Random(seed)
    words: list[str] = []
    while count(" ".join(words)) < n:  # grow by doubling until the text holds n tokens
        words += rng.choices(WORDS, k=max(1, len(words)))
    lo, hi = 0, len(words)  # the longest prefix of words with count <= n (count grows with it)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])
