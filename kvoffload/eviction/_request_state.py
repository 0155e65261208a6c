"""Per-request state that managers and eviction policies keep on the ``ReqContext``.

One context is shared by every tier a request goes through, so state is filed under its owner
(a policy or manager instance, :meth:`ReqContext.setdefault_state`): two instances (two tiers,
or a manager and its twin) never read each other's. A state is stamped with its owner's
*generation* (bumped when the owner is cleared), so state a request kept from before a reset is
dropped instead of being applied to the blocks stored after it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import itemgetter
from typing import TypeVar

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = [
    "GroupWatch",
    "RequestChains",
    "RequestState",
    "RequestUses",
    "in_one_group",
    "request_state",
    "take_request_state",
]

_group_of = itemgetter(slice(-4, None))  # an OffloadKey's group bytes (big-endian: sorts as ints)
_SEP = bytes.fromhex("9e3779b97f4a7c15f39cc0605cedc834")  # see in_one_group


class RequestState:
    """Base of a per-request state: the owner's generation it was made in."""

    __slots__ = ("generation",)

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation


_S = TypeVar("_S", bound=RequestState)


def request_state(ctx: ReqContext, owner: object, cls: type[_S], generation: int = 0) -> _S:
    """The (mutable) state that ``owner`` keeps for this request: made with ``cls(generation)``
    on first use, and made anew when it was made in another generation."""
    state: _S = ctx.setdefault_state(owner, cls, generation)
    if state.generation != generation:
        ctx.pop_state(owner)
        state = ctx.setdefault_state(owner, cls, generation)
    return state


def take_request_state(
    ctx: ReqContext, owner: object, cls: type[_S], generation: int = 0
) -> _S | None:
    """Detach and return ``owner``'s state for this request, made by :func:`request_state` with
    ``cls`` (``None`` if it kept none in ``generation``)."""
    state = ctx.pop_state(owner)
    return state if isinstance(state, cls) and state.generation == generation else None


class RequestChains(RequestState):
    """The key runs one request stored in a tier and the key lists it touched (each list once),
    in call order: what a FIFO policy's ``request_finished`` reorders."""

    __slots__ = ("stored", "touched")

    def __init__(self, generation: int = 0) -> None:
        super().__init__(generation)
        self.stored: list[Sequence[OffloadKey]] = []
        self.touched: list[Sequence[OffloadKey]] = []


class RequestUses(RequestState):
    """What one request did in one tier, recorded by the manager as vLLM 0.33's manager does.

    ``runs``: one per ``prepare_load`` and per ``prepare_store`` (in call order): ``keys``, the
    keys the call counts as the request's *access* (a load's keys; a store's keys it stores or
    finds already stored and ready, in the order offered), ``reused``, the ready blocks among
    them, and ``inserted``, the keys the call stored (empty when it could not). ``touch`` is not
    recorded: it reorders at once. Store misses are counted once per request and key
    (:meth:`first_misses`).
    """

    __slots__ = ("_first_misses", "_missed", "runs")

    def __init__(self, generation: int = 0) -> None:
        super().__init__(generation)
        self.runs: list[tuple[Sequence[OffloadKey], Sequence[OffloadKey], Sequence[OffloadKey]]]
        self.runs = []
        self._first_misses: Sequence[OffloadKey] | None = None
        self._missed: set[OffloadKey] | None = None  # made when a second store needs it

    def first_misses(self, keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        """The keys of ``keys`` (absent, about to be stored) that were no store miss of this
        request before, in order; now they are. A request's first store pays nothing."""
        missed = self._missed
        if missed is None:
            if self._first_misses is None:
                self._first_misses = keys
                return keys
            missed = self._missed = set(self._first_misses)
        new = [key for key in keys if key not in missed]
        missed.update(new)
        return new

    def head_to_tail(self, ctx: ReqContext, one_group: bool = False) -> list[OffloadKey]:
        """Every key of the request's access, head to tail, as vLLM orders them at finish: by
        KV-cache group (ascending), each group in the order first seen or, when the request has
        a position for every key of the group, by position; when it has one for every key, all
        by position (groups breaking ties). A key may repeat: its first occurrence is its place
        (a policy that walks the list tail first and moves each key ends as if it met the key
        once: deduplicating would cost as much as the walk). ``one_group``: the caller holds
        keys of one group only (see :class:`GroupWatch`), so the group order cannot change the
        order of the keys it holds and is skipped.
        """
        keys: list[OffloadKey] = []
        for run in self.runs:
            keys += run[0]
        if keys and not one_group and not in_one_group(keys, keys[0][-4:]):
            keys.sort(key=_group_of)
        positions = ctx.offload_key_positions
        if not positions:
            return keys
        return _by_position(keys, positions)

    def reused_and_inserted(self) -> tuple[set[OffloadKey], set[OffloadKey]]:
        """The ready blocks the request reused (not stored by itself before), and the keys it
        stored."""
        reused: set[OffloadKey] = set()
        inserted: set[OffloadKey] = set()
        for _, ready, stored in self.runs:
            if ready:  # a reuse of a block the request stored itself is not one
                reused.update(set(ready).difference(inserted) if inserted else ready)
            inserted.update(stored)
        return reused, inserted


def in_one_group(keys: Sequence[OffloadKey], group: bytes) -> bool:
    """Whether every key of ``keys`` (not empty) is in KV-cache group ``group`` (its 4 bytes).

    In C, not with a slice per key (which would cost as much as the rest of a request's
    finish): ``group + _SEP`` occurs in the keys joined by ``_SEP`` once per key that ends with
    ``group``, and elsewhere only inside a key whose hash holds the 16 bytes of ``_SEP``.
    """
    return keys[-1].endswith(group) and _SEP.join(keys).count(group + _SEP) == len(keys) - 1


class GroupWatch:
    """Whether every key a policy was given since it was cleared is of one KV-cache group."""

    __slots__ = ("group", "mixed")

    def __init__(self) -> None:
        self.group: bytes | None = None
        self.mixed = False

    def saw(self, keys: Sequence[OffloadKey]) -> None:
        """The policy was given ``keys`` (inserted)."""
        if self.mixed or not keys:
            return
        if self.group is None:
            self.group = keys[0][-4:]
        self.mixed = not in_one_group(keys, self.group)

    def clear(self) -> None:
        self.group, self.mixed = None, False


def _by_position(keys: list[OffloadKey], positions: dict[OffloadKey, int]) -> list[OffloadKey]:
    """``keys`` (grouped) reordered by position as in :meth:`RequestUses.head_to_tail`."""
    if all(key in positions for key in keys):
        return sorted(keys, key=lambda key: (positions[key], _group_of(key)))
    out: list[OffloadKey] = []
    for _, group in itertools.groupby(keys, _group_of):
        run = list(group)
        if all(key in positions for key in run):
            run.sort(key=positions.__getitem__)
        out += run
    return out
