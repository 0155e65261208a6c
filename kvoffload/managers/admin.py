"""Operator controls over a manager stack, by block keys: which tiers hold a prefix, pins, and
clears of the host and disk tiers.

:class:`TierAdmin` is the Python API of a tiering manager (or a bare host tier) for tools that
have keys and no model: the engine's :class:`~kvoffload.engine.admin.EngineAdmin` adds
tokenization, the device cache, KV events, the remote tier's clear and disk-pin persistence on
top of it. Not thread-safe: call it from the thread that calls the managers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, OffloadingManager, ReqContext
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.pins import HostPinSite, PinSite, PinTable, PolicyPinSite
from kvoffload.managers.reuse import FilterReusedOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.tiers.contract import SecondaryTier

__all__ = ["TierAdmin", "leading"]

#: Rounds of asking a remote tier during one lookup (each waits at most its answer bound).
_ASK_ROUNDS = 3
_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY


def leading(hits: Sequence[bool]) -> int:
    """The length of the leading run of ``True`` in ``hits``."""
    n = 0
    for hit in hits:
        if not hit:
            break
        n += 1
    return n


class TierAdmin:
    """Operator controls over ``manager`` (the outermost manager of an offload stack: a reuse
    filter, a tiering manager or a host tier). ``pin_quota``: the share of the host and disk
    tiers' capacity that pins may hold."""

    def __init__(self, manager: OffloadingManager, pin_quota: float = 0.5) -> None:
        if not 0 <= pin_quota <= 1:
            raise ConfigError("kv_pin_quota", f"must be in [0, 1], got {pin_quota!r}")
        if isinstance(manager, FilterReusedOffloadingManager):
            manager = manager.backing
        self.tiering = manager if isinstance(manager, TieringOffloadingManager) else None
        host = self.tiering.host if self.tiering is not None else manager
        if not isinstance(host, CPUOffloadingManager):
            raise ConfigError("manager", f"no host tier behind {type(manager).__name__}")
        self.host = host
        self.secondary: dict[str, SecondaryTier] = (
            {t.name: t for t in self.tiering.tiers} if self.tiering is not None else {}
        )
        sites: dict[str, PinSite] = {"host": HostPinSite(host)}
        quotas = {"host": int(host.num_blocks * pin_quota)}
        disk = self.secondary.get("disk")
        if disk is not None and hasattr(disk, "index"):
            sites["disk"] = PolicyPinSite(disk.index)
            quotas["disk"] = int(getattr(disk, "capacity_blocks", 0) * pin_quota)
        self.pins = PinTable(sites, quotas)

    @property
    def tiers(self) -> list[str]:
        """The tiers of the stack, nearest first (``host``, then the secondary tiers)."""
        return ["host", *self.secondary]

    def held(self, keys: Sequence[OffloadKey]) -> tuple[dict[str, list[bool]], bool]:
        """Per tier, which of ``keys`` it holds readable (a remote tier is asked afresh, within
        its answer bound); and whether every key was answered."""
        get = self.host.policy.get
        held = {"host": [(b := get(k)) is not None and b.ref_cnt >= 0 for k in keys]}
        complete = True
        for name, tier in self.secondary.items():
            held[name], answered = _ask(tier, keys)
            complete = complete and answered
        return held, complete

    def ready_in(self, keys: Sequence[OffloadKey], tiers: Sequence[str]) -> bool:
        """Whether every key is readable in the host tier and, as far as each secondary tier of
        ``tiers`` knows without asking its server, held there (a warm-up's end)."""
        get = self.host.policy.get
        if not all((b := get(k)) is not None and b.ref_cnt >= 0 for k in keys):
            return False
        ctx = ReqContext("kvoffload-admin-ready")
        try:
            return all(tier.lookup(k, ctx) is _HIT for name, tier in self.secondary.items()
                       if name in tiers for k in keys)
        finally:
            for tier in self.secondary.values():
                tier.request_finished(ctx)

    def drop_evictable(self, tiers: Sequence[str]) -> dict[str, int]:
        """Remove every ready, unreferenced block of the host and disk tiers named (pinned
        blocks and blocks being moved stay), as evictions (removal events, ``evicted_blocks``);
        the number removed per tier."""
        removed: dict[str, int] = {}
        if "host" in tiers:
            dropped = (self.tiering.drop_host_evictable() if self.tiering is not None
                       else self.host.drop_evictable())
            removed["host"] = len(dropped)
        for name, tier in self.secondary.items():
            if name in tiers and hasattr(tier, "drop_evictable"):
                removed[name] = len(tier.drop_evictable())
        return removed


def _ask(tier: SecondaryTier, keys: Sequence[OffloadKey]) -> tuple[list[bool], bool]:
    """Which of ``keys`` ``tier`` holds (readable), asking its server if needed; and whether
    every key was answered."""
    ctx = ReqContext("kvoffload-admin-lookup")
    tier.forget_misses(keys)  # the server's answer of now, not a miss believed a while
    try:
        answers = [tier.lookup(k, ctx) for k in keys]
        for _ in range(_ASK_ROUNDS):
            if _RETRY not in answers:
                break
            tier.wait_for_answers()
            answers = [a if a is not _RETRY else tier.lookup(k, ctx)
                       for k, a in zip(keys, answers, strict=True)]
    finally:
        tier.request_finished(ctx)
    return [a is _HIT for a in answers], _RETRY not in answers
