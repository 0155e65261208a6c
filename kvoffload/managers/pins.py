"""Operator pins: prefixes whose blocks no eviction takes from the tiers named, until unpinned.

A pin holds one reference on each of its blocks in each tier it names, the same reference a
reader holds between ``prepare_load`` and ``complete_load`` (``OffloadedBlock.ref_cnt``): every
eviction policy already passes over referenced blocks, and every tier's eviction already refuses
to take them, so a pinned block stays whatever the traffic does. Pins are reference-counted per
block: two pins of one prefix (two owners) hold it once, and it goes back to the policy when the
last of them is unpinned or expires.

Invariants (checked by :meth:`PinTable.check_invariants`):

* each tier holds at most its **quota** of distinct pinned blocks; a pin that would pass it is
  refused whole (:class:`PinQuotaExceeded`), nothing pinned;
* a pin is all or nothing: every block of it is ready in every tier it names, or it is refused
  (:class:`NotCached`) and nothing is pinned;
* a block is pinned in a tier (one reference held there) exactly while some pin holds it there.

Expiry (``ttl_s``) is checked by :meth:`PinTable.expire` in O(1) when nothing is due (a heap of
deadlines). Costs: O(blocks of the pin) per pin and unpin; nothing per engine step or lookup.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.eviction.base import EvictionPolicy, OffloadedBlock
from kvoffload.keys import OffloadKey
from kvoffload.managers.cpu import CPUOffloadingManager

__all__ = [
    "HostPinSite",
    "NotCached",
    "Pin",
    "PinQuotaExceeded",
    "PinSite",
    "PinTable",
    "PolicyPinSite",
]


class NotCached(KVOffloadError):
    """A pin's blocks are not all ready in a tier it names (``tier``, ``missing`` blocks)."""

    def __init__(self, tier: str, missing: int, total: int) -> None:
        super().__init__(f"{missing} of the prefix's {total} blocks are not ready in the {tier} tier")
        self.tier = tier
        self.missing = missing


class PinQuotaExceeded(KVOffloadError):
    """A pin would hold more distinct blocks of ``tier`` than its quota; nothing was pinned."""

    def __init__(self, tier: str, pinned: int, adding: int, quota: int) -> None:
        super().__init__(
            f"pin refused: the {tier} tier's pinned quota is {quota} blocks, {pinned} are pinned "
            f"and this pin adds {adding}; unpin something or raise the quota"
        )
        self.tier = tier


class PinSite(Protocol):
    """One tier as pins see it: reference its ready blocks, release them."""

    def ready(self, key: OffloadKey) -> bool:
        """Whether ``key`` is held and readable (not being written)."""

    def hold(self, keys: Sequence[OffloadKey]) -> None:
        """Take one reference on each of ``keys`` (all ready: checked by the caller)."""

    def release(self, keys: Sequence[OffloadKey]) -> None:
        """Drop one reference on each of ``keys`` taken by :meth:`hold`."""

    def generation(self) -> int:
        """Moves each time the tier forgets every block at once (a reset): its references are
        gone with its blocks."""


class HostPinSite:
    """The host tier: references through :meth:`CPUOffloadingManager.pin` (which keeps its
    count of evictable blocks right), released with ``complete_load``."""

    def __init__(self, host: CPUOffloadingManager) -> None:
        self.host = host

    def ready(self, key: OffloadKey) -> bool:
        block = self.host.policy.get(key)
        return block is not None and block.ref_cnt >= 0

    def hold(self, keys: Sequence[OffloadKey]) -> None:
        self.host.pin(keys)
        self.host.policy.pinned(keys)

    def release(self, keys: Sequence[OffloadKey]) -> None:
        self.host.unpin(keys)
        self.host.policy.unpinned(keys)

    def generation(self) -> int:
        return self.host.policy.generation


class PolicyPinSite:
    """A secondary tier whose index is an :class:`EvictionPolicy` of ref-counted records (the
    disk tier): its eviction passes over referenced blocks, as over blocks being loaded."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy

    def ready(self, key: OffloadKey) -> bool:
        block = self.policy.get(key)
        return block is not None and block.ref_cnt >= 0

    def hold(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            block: OffloadedBlock | None = self.policy.get(key)
            if block is not None:
                block.ref_cnt += 1
        self.policy.pinned(keys)

    def release(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            block: OffloadedBlock | None = self.policy.get(key)
            if block is not None and block.ref_cnt > 0:
                block.ref_cnt -= 1
        self.policy.unpinned(keys)

    def generation(self) -> int:
        return self.policy.generation


@dataclass(slots=True)
class Pin:
    """One operator pin: ``keys`` (a prefix, head first) held in ``tiers`` for ``owner``.

    ``pin_id`` is ``owner/<hex of the last block's key>``: pinning the same prefix
    for the same owner again renews the pin (its tiers and TTL) instead of adding one.
    """

    pin_id: str
    owner: str
    keys: tuple[OffloadKey, ...]
    tiers: tuple[str, ...]
    num_tokens: int
    created: float  # wall clock (time.time())
    expires_at: float | None  # wall clock, or None: until unpinned

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.pin_id,
            "owner": self.owner,
            "tiers": list(self.tiers),
            "blocks": len(self.keys),
            "tokens": self.num_tokens,
            "created": self.created,
            "expires_at": self.expires_at,
        }


def pin_id_of(owner: str, keys: Sequence[OffloadKey]) -> str:
    """The id of ``owner``'s pin of the prefix ending with ``keys[-1]`` (the whole prefix: its
    last block's key names it, hashes being chained)."""
    return f"{owner}/{keys[-1].hex()}"


def check_owner(owner: Any) -> str:
    """``owner`` as a pin's owner label: 1 to 64 printable characters without ``/``."""
    if not isinstance(owner, str) or not 0 < len(owner) <= 64 or "/" in owner or not owner.isprintable():
        raise ConfigError("owner", f"must be 1 to 64 printable characters without '/', got {owner!r}")
    return owner


def check_ttl(ttl_s: Any) -> float | None:
    """``ttl_s`` as a pin's lifetime in seconds: ``None`` (until unpinned) or a number > 0."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s < 10**9:
        raise ConfigError("ttl_s", f"must be a number of seconds > 0, or absent; got {ttl_s!r}")
    return float(ttl_s)


@dataclass
class PinTable:
    """The pins of one engine over its tiers' :class:`PinSite` s (see the module docstring).

    ``quotas``: the most distinct blocks each tier may hold pinned. Not thread-safe: called from
    the thread that owns the managers (the engine's).

    A tier reset (``reset()`` of the manager, vLLM's ``reset_cache``) drops every block of the
    tier, pinned ones too: each call here first notices a tier whose :meth:`PinSite.generation`
    moved (O(tiers)), drops that tier from every pin and a pin left with no tier.
    """

    sites: dict[str, PinSite]
    quotas: dict[str, int]
    clock: Any = time.time
    _pins: dict[str, Pin] = field(default_factory=dict)
    _holders: dict[str, dict[OffloadKey, int]] = field(default_factory=dict)
    _deadlines: list[tuple[float, str]] = field(default_factory=list)
    _generations: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tier, site in self.sites.items():
            self._holders[tier] = {}
            self._generations[tier] = site.generation()

    def _forget_reset_tiers(self) -> list[Pin]:
        """Drop the pins' hold on the tiers reset since the last call (their blocks, and the
        references on them, are gone: nothing to release); the pins changed or removed."""
        generations = self._generations
        reset = {t for t, site in self.sites.items() if site.generation() != generations[t]}
        if not reset:
            return []
        for tier in reset:
            generations[tier] = self.sites[tier].generation()
            self._holders[tier].clear()
        changed = []
        for pin in list(self._pins.values()):
            kept = tuple(t for t in pin.tiers if t not in reset)
            if kept != pin.tiers:
                changed.append(pin)
                pin.tiers = kept
                if not kept:
                    del self._pins[pin.pin_id]
        return changed

    def pinned_blocks(self, tier: str) -> int:
        """Distinct blocks pinned in ``tier``."""
        self._forget_reset_tiers()
        return len(self._holders.get(tier, ()))

    def pin(
        self,
        owner: str,
        keys: Sequence[OffloadKey],
        tiers: Sequence[str],
        num_tokens: int,
        ttl_s: float | None = None,
    ) -> Pin:
        """Pin ``keys`` in ``tiers`` for ``owner`` (renewing that owner's pin of the same prefix);
        all or nothing. Raises :class:`ConfigError` (bad owner, TTL, tier, empty prefix),
        :class:`NotCached`, :class:`PinQuotaExceeded`."""
        check_owner(owner)
        ttl = check_ttl(ttl_s)
        self._forget_reset_tiers()
        if not keys:
            raise ConfigError("prompt", "holds no full block: there is nothing to pin")
        unknown = [t for t in tiers if t not in self.sites]
        if unknown or not tiers:
            raise ConfigError("tiers", f"pins hold {sorted(self.sites)}, got {list(tiers)}")
        keys = tuple(dict.fromkeys(keys))
        tiers = tuple(dict.fromkeys(tiers))
        pin_id = pin_id_of(owner, keys)
        old = self._pins.get(pin_id)
        for tier in tiers:  # the quota first: a pin it refuses is not worth computing
            holders = self._holders[tier]
            adding = sum(1 for k in keys if k not in holders)
            freed = 0
            if old is not None and tier in old.tiers:  # the renewed pin's own blocks go
                freed = sum(1 for k in old.keys if holders.get(k) == 1 and k not in keys)
            if len(holders) - freed + adding > self.quotas.get(tier, 0):
                raise PinQuotaExceeded(tier, len(holders), adding, self.quotas.get(tier, 0))
        for tier in tiers:
            site, holders = self.sites[tier], self._holders[tier]
            missing = sum(1 for k in keys if k not in holders and not site.ready(k))
            if missing:
                raise NotCached(tier, missing, len(keys))
        now = self.clock()
        pin = Pin(pin_id, owner, keys, tiers, num_tokens, now, None if ttl is None else now + ttl)
        self._hold(pin)
        if old is not None:
            pin.created = old.created
            self._release(old)
        self._pins[pin_id] = pin
        if pin.expires_at is not None:
            heapq.heappush(self._deadlines, (pin.expires_at, pin_id))
        return pin

    def _hold(self, pin: Pin) -> None:
        for tier in pin.tiers:
            holders = self._holders[tier]
            fresh = [k for k in pin.keys if k not in holders]
            self.sites[tier].hold(fresh)
            for k in pin.keys:
                holders[k] = holders.get(k, 0) + 1

    def _release(self, pin: Pin) -> None:
        for tier in pin.tiers:
            holders = self._holders[tier]
            freed = []
            for k in pin.keys:
                n = holders[k] - 1
                if n:
                    holders[k] = n
                else:
                    del holders[k]
                    freed.append(k)
            self.sites[tier].release(freed)

    def unpin(
        self, pin_id: str | None = None, owner: str | None = None,
        keys: Sequence[OffloadKey] | None = None,
    ) -> list[Pin]:
        """Remove the pins that match every criterion given (an id; an owner; a prefix: pins
        whose prefix ends with ``keys[-1]``); returns them. At least one criterion is needed."""
        if pin_id is None and owner is None and not keys:
            raise ConfigError("unpin", "name a pin id, an owner or a prompt")
        self._forget_reset_tiers()
        last = keys[-1] if keys else None
        gone = [
            p for p in self._pins.values()
            if (pin_id is None or p.pin_id == pin_id)
            and (owner is None or p.owner == owner)
            and (last is None or p.keys[-1] == last)
        ]
        for pin in gone:
            del self._pins[pin.pin_id]
            self._release(pin)
        return gone

    def unpin_tier(self, tier: str) -> list[Pin]:
        """Remove every pin that names ``tier`` (all of it, its other tiers too)."""
        self._forget_reset_tiers()
        gone = [p for p in self._pins.values() if tier in p.tiers]
        for pin in gone:
            del self._pins[pin.pin_id]
            self._release(pin)
        return gone

    def expire(self) -> list[Pin]:
        """Remove the pins whose TTL has passed, and forget what tier resets dropped; the pins
        removed or changed. O(tiers) when nothing is due."""
        gone = self._forget_reset_tiers()
        deadlines = self._deadlines
        if not deadlines or deadlines[0][0] > self.clock():
            return gone
        now = self.clock()
        while deadlines and deadlines[0][0] <= now:
            expires_at, pin_id = heapq.heappop(deadlines)
            pin = self._pins.get(pin_id)
            if pin is not None and pin.expires_at == expires_at:  # not renewed since
                del self._pins[pin_id]
                self._release(pin)
                gone.append(pin)
        return gone

    def pins(self) -> list[Pin]:
        """The live pins, oldest first."""
        self.expire()
        return sorted(self._pins.values(), key=lambda p: (p.created, p.pin_id))

    def pin_ids(self) -> list[str]:
        """The ids of the live pins (expired ones included until :meth:`expire` runs)."""
        self._forget_reset_tiers()
        return list(self._pins)

    def pinned_keys(self, tier: str) -> Iterable[OffloadKey]:
        self._forget_reset_tiers()
        return self._holders.get(tier, {}).keys()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if reference counts and pins disagree (tests only)."""
        self._forget_reset_tiers()
        for tier, holders in self._holders.items():
            expected: dict[OffloadKey, int] = {}
            for pin in self._pins.values():
                if tier in pin.tiers:
                    for k in pin.keys:
                        expected[k] = expected.get(k, 0) + 1
            assert expected == holders, f"{tier}: holders disagree with the pins"
            assert len(holders) <= self.quotas.get(tier, 0), f"{tier}: over its quota"
