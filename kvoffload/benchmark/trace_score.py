"""How a trace replay is scored: token weights from ``input_length``, and a warm-up window.

A request's ``input_length`` tokens fill its blocks in order, ``block_size`` tokens each: block
``i`` holds ``min(block_size, max(1, input_length - i * block_size))`` tokens (the last one is
usually partial; a block is never counted as empty). A request that hits its first ``h`` blocks
hits their tokens. Two figures, over the scored requests only:

``token_hit_rate``
    hit tokens / input tokens (what vLLM's prefix-cache hit rate counts).
``block_hit_ratio``
    hit blocks / blocks.

The warm-up is the first ``floor(n * warmup_fraction)`` of the ``n`` requests: they are replayed
but not scored. A capacity is *filled* when the warm-up names at least that many distinct blocks
(every policy keeps every new block until it is full, so it is full before the scored window
starts exactly then); with a warm-up, an unfilled capacity is not scored (its figures would
measure the cold start). Without one, every capacity is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ScoredTrace", "block_tokens"]


def block_tokens(input_length: int, blocks: int, block_size: int) -> list[int]:
    """The tokens of each of a request's ``blocks`` blocks (module docstring)."""
    return [min(block_size, max(1, input_length - i * block_size)) for i in range(blocks)]


@dataclass(frozen=True)
class ScoredTrace:
    """A trace ready to score: ``requests`` (block ids in prefix order), ``tokens`` (the tokens
    of each block, as :func:`block_tokens`), ``warmup`` (the number of leading requests not
    scored) and ``warmup_blocks`` (the distinct blocks they name: the largest capacity the
    warm-up fills)."""

    requests: Sequence[Sequence[int]]
    tokens: Sequence[Sequence[int]]
    warmup: int
    warmup_blocks: int

    @classmethod
    def build(
        cls,
        requests: Sequence[Sequence[int]],
        input_lengths: Sequence[int],
        block_size: int,
        warmup_fraction: float,
    ) -> ScoredTrace:
        """The trace with token weights from ``input_lengths`` and a warm-up of the first
        ``floor(len(requests) * warmup_fraction)`` requests."""
        tokens = [
            block_tokens(length, len(ids), block_size)
            for ids, length in zip(requests, input_lengths, strict=True)
        ]
        warmup = math.floor(len(requests) * warmup_fraction)
        return cls(requests, tokens, warmup, len(set().union(*requests[:warmup])))

    def filled(self, capacity: int) -> bool:
        """Whether ``capacity`` is scored: no warm-up, or the warm-up fills it."""
        return self.warmup == 0 or capacity <= self.warmup_blocks

    def input_tokens(self) -> int:
        """Input tokens of the scored requests."""
        return sum(sum(t) for t in self.tokens[self.warmup :])

    def scored_blocks(self) -> int:
        return sum(len(ids) for ids in self.requests[self.warmup :])

    def token_hit_rate(self, hits: Sequence[int]) -> float:
        """Hit tokens / input tokens of the scored requests, ``hits[i]`` the prefix hits of
        request ``i``."""
        hit = sum(
            sum(t[:h]) for t, h in zip(self.tokens[self.warmup :], hits[self.warmup :], strict=True)
        )
        return hit / max(self.input_tokens(), 1)

    def block_hit_ratio(self, hits: Sequence[int]) -> float:
        """Hit blocks / blocks of the scored requests."""
        return sum(hits[self.warmup :]) / max(self.scored_blocks(), 1)
