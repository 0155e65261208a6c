"""Per-request scratch state that eviction policies keep on the ``ReqContext``.

One context is shared by every tier a request goes through, and context state is keyed by type,
so a policy must not keep instance-specific data in a state object of its own type alone: two
instances (two tiers, or a manager and its twin) would read each other's. These helpers key by
policy instance, or hand out request numbers that are unique across instances.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvoffload.base import ReqContext
from kvoffload.keys import OffloadKey

__all__ = [
    "RequestUses",
    "keys_seen_by",
    "lists_touched_by",
    "request_serial",
    "take_uses",
    "uses_recorded_by",
]

_serials = itertools.count(1)  # process-wide: serials never repeat, whichever policy asks


class _KeysSeen:
    __slots__ = ("by_owner",)

    def __init__(self) -> None:
        self.by_owner: dict[object, set[OffloadKey]] = {}


class RequestUses:
    """What one request touched and stored in one tier, each a list of key sequences."""

    __slots__ = ("stored", "touched")

    def __init__(self) -> None:
        self.touched: list[Sequence[OffloadKey]] = []
        self.stored: list[Sequence[OffloadKey]] = []


class _Uses:
    __slots__ = ("by_owner",)

    def __init__(self) -> None:
        self.by_owner: dict[object, RequestUses] = {}


class _ListsTouched:
    __slots__ = ("by_owner",)

    def __init__(self) -> None:
        self.by_owner: dict[object, list[Sequence[OffloadKey]]] = {}


class _Serial:
    __slots__ = ("serial",)

    def __init__(self) -> None:
        self.serial = next(_serials)


def keys_seen_by(ctx: ReqContext, owner: object) -> set[OffloadKey]:
    """The (mutable) set of keys ``owner`` has already counted for this request."""
    state = ctx.get_state(_KeysSeen)
    if state is None:
        state = _KeysSeen()
        ctx.set_state(state)
    seen = state.by_owner.get(owner)
    if seen is None:
        seen = state.by_owner[owner] = set()
    return seen


def request_serial(ctx: ReqContext) -> int:
    """A number identifying this request, unique in the process (any policy may share it)."""
    state = ctx.get_state(_Serial)
    if state is None:
        state = _Serial()
        ctx.set_state(state)
    return state.serial


def uses_recorded_by(ctx: ReqContext, owner: object) -> RequestUses:
    """The (mutable) record of what ``owner`` saw this request touch and store."""
    state = ctx.get_state(_Uses)
    if state is None:
        state = _Uses()
        ctx.set_state(state)
    uses = state.by_owner.get(owner)
    if uses is None:
        uses = state.by_owner[owner] = RequestUses()
    return uses


def take_uses(ctx: ReqContext, owner: object) -> RequestUses | None:
    """Detach and return what ``owner`` recorded for this request (``None`` if nothing)."""
    state = ctx.get_state(_Uses)
    if state is None:
        return None
    uses = state.by_owner.pop(owner, None)
    if not state.by_owner:
        ctx.pop_state(_Uses)
    return uses


def lists_touched_by(ctx: ReqContext, owner: object) -> list[Sequence[OffloadKey]]:
    """The (mutable) list of key sequences ``owner`` already counted for this request, by identity:
    one check per call instead of one per key, for a scheduler that re-touches the same list."""
    state = ctx.get_state(_ListsTouched)
    if state is None:
        state = _ListsTouched()
        ctx.set_state(state)
    lists = state.by_owner.get(owner)
    if lists is None:
        lists = state.by_owner[owner] = []
    return lists
