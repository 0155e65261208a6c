"""What the tiering manager keeps per request: the secondary tiers it may use, the blocks it
must not wait for, and the host hits of its current lookup pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = ["RequestTiers", "validate_tier_params"]


def validate_tier_params(params: Mapping[str, Any] | None, names: Sequence[str]) -> None:
    """Check ``kv_load_tiers`` / ``kv_store_tiers`` of a request: lists of known tier names."""
    if not params:
        return
    for field in ("kv_load_tiers", "kv_store_tiers"):
        value = params.get(field)
        if value is None:
            continue
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"kv_transfer_params.{field}", f"must be a list, got {value!r}")
        unknown = [v for v in value if v not in names]
        if unknown:
            raise ConfigError(
                f"kv_transfer_params.{field}",
                f"unknown tiers {unknown}; this engine has {list(names)}",
            )


class RequestTiers:
    """Per-request state (on the ReqContext).

    ``load_tiers`` / ``store_tiers``: indexes of the secondary tiers the request may promote from
    / cascade to (``kv_transfer_params["kv_load_tiers"]`` / ``["kv_store_tiers"]``; all when
    absent). ``failed``: blocks whose promotion failed or was refused for it (it recomputes
    them). ``scan``: its host hits in the lookup pass of step ``scan_step``, of which
    ``scan_evictable`` were evictable when looked up (protected while its promotions reserve).
    """

    __slots__ = ("failed", "load_tiers", "scan", "scan_evictable", "scan_step", "store_tiers")

    def __init__(self, load_tiers: list[int], store_tiers: list[int]) -> None:
        self.load_tiers = load_tiers
        self.store_tiers = store_tiers
        self.failed: set[OffloadKey] = set()
        self.scan: list[OffloadKey] = []
        self.scan_evictable = 0
        self.scan_step = -1

    @classmethod
    def of(cls, ctx: ReqContext, tier_names: Sequence[str], every_tier: list[int]) -> RequestTiers:
        """Fresh state for ``ctx`` from its ``kv_transfer_params``; ``every_tier`` (the indexes of
        ``tier_names``) is shared by every request that does not choose."""
        params = ctx.kv_transfer_params
        return cls(
            _selected(params.get("kv_load_tiers"), tier_names, every_tier),
            _selected(params.get("kv_store_tiers"), tier_names, every_tier),
        )

    def begin_scan(self, step: int) -> None:
        """Start the request's lookup pass of ``step`` (a pass per step; hits of older ones no
        longer count)."""
        if self.scan_step != step:
            self.scan_step = step
            self.scan.clear()
            self.scan_evictable = 0


def _selected(
    names: Sequence[str] | None, tier_names: Sequence[str], every_tier: list[int]
) -> list[int]:
    if names is None:
        return every_tier
    return [i for i, name in enumerate(tier_names) if name in names]
