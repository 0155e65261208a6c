"""What the remote tier knows about the server's keys, on the scheduler's thread only.

* **Hits**, each with the time it stops being believed: never for a server that keeps blocks
  until evicted; with ``kv_remote_ttl_s``, the server's expiry, counted from before the ``SET``
  was sent (so the tier forgets a hit no later than the server drops the block) or from the
  ``PTTL`` answer's remaining time, counted from before the question was sent. An expired hit
  is forgotten: the key is asked again, and a store of it writes it again.
* **Misses**, believed for ``miss_ttl_s`` (another engine may store the block meanwhile).
* **Questions** in flight, with the time after which the key counts as a miss for now.
* **Writing**: keys this tier is storing (``HIT_PENDING``).

An unknown answer (the round trip failed) records nothing: the key is asked again once the
server is up. Hits and misses are bounded by ``max_known``, the oldest forgotten first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult

__all__ = ["FOREVER", "RemoteAnswers"]

FOREVER = math.inf
_HIT, _MISS, _RETRY, _PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)


class RemoteAnswers:
    """The answer cache of :class:`~kvoffload.tiers.redis.tier.RedisTier` (module docstring)."""

    __slots__ = ("asked", "hits", "lookup_wait_s", "max_known", "miss_ttl_s", "misses", "writing")

    def __init__(self, lookup_wait_s: float, miss_ttl_s: float, max_known: int) -> None:
        self.lookup_wait_s = lookup_wait_s
        self.miss_ttl_s = miss_ttl_s
        self.max_known = max_known
        self.hits: dict[OffloadKey, float] = {}
        self.misses: dict[OffloadKey, float] = {}
        self.asked: dict[OffloadKey, float] = {}
        self.writing: set[OffloadKey] = set()

    def answer(self, key: OffloadKey) -> LookupResult | None:
        """``HIT``, ``HIT_PENDING``, ``MISS``, ``RETRY`` (asked, no answer yet), or ``None``:
        nothing known, the server must be asked (:meth:`ask`)."""
        until = self.hits.get(key)
        if until is not None:
            if until is FOREVER or until > time.monotonic():
                return _HIT
            del self.hits[key]
        if key in self.writing:
            return _PENDING
        now = time.monotonic()
        until = self.misses.get(key)
        if until is not None:
            if until > now:
                return _MISS
            del self.misses[key]
        deadline = self.asked.get(key)
        if deadline is not None:
            return _RETRY if now < deadline else _MISS
        return None

    def holds(self, key: OffloadKey) -> bool:
        """The key is a hit not expired, or being written (no question is asked)."""
        until = self.hits.get(key)
        if until is not None and (until is FOREVER or until > time.monotonic()):
            return True
        return key in self.writing

    def ask(self, key: OffloadKey, now: float) -> None:
        """``key`` was asked at ``now`` (``time.monotonic()``)."""
        self.asked[key] = now + self.lookup_wait_s

    def learned(self, keys: Sequence[OffloadKey], ttls: Sequence[int | None], asked_at: float):
        """Apply the server's answers to ``keys``: ``PTTL`` results (-2 missing, -1 kept until
        evicted, else milliseconds left) from a question sent at ``asked_at``; ``None`` for an
        unknown answer."""
        now = time.monotonic()
        miss_until = now + self.miss_ttl_s
        asked, hits, writing, misses = self.asked, self.hits, self.writing, self.misses
        for key, ttl in zip(keys, ttls, strict=True):
            asked.pop(key, None)
            if ttl is None or key in hits or key in writing:
                continue
            if ttl == -1:
                self._hit(key, FOREVER)
            elif ttl >= 0 and asked_at + ttl / 1000 > now:
                self._hit(key, asked_at + ttl / 1000)
            else:  # missing (or expired by now); re-inserted: the oldest entries stay first
                misses.pop(key, None)
                misses[key] = miss_until
        while len(misses) > self.max_known:
            del misses[next(iter(misses))]

    def stored(self, keys: Sequence[OffloadKey], until: float) -> None:
        """``keys`` were written (``until``: when the server expires them)."""
        for key in keys:
            self.misses.pop(key, None)
            self._hit(key, until)

    def gone(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """A load found ``keys`` missing or damaged: forget them. Returns those that were hits."""
        hits = self.hits
        return [key for key in keys if hits.pop(key, None) is not None]

    def clear(self) -> None:
        self.hits.clear()
        self.misses.clear()
        self.asked.clear()

    def _hit(self, key: OffloadKey, until: float) -> None:
        hits = self.hits
        hits.pop(key, None)  # re-insert: the oldest entries stay first
        hits[key] = until
        if len(hits) > self.max_known:
            del hits[next(iter(hits))]
