"""The scheduler-side offloading contract: :class:`OffloadingManager` and its data types.

A manager is bookkeeping only: it knows which blocks a tier holds, which are readable, which are
pinned by in-flight transfers, and which to evict. It never moves bytes (the worker side does) and
imports no torch. ``docs/manager-contract.md`` states the whole contract with its invariants.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from kvoffload.keys import OffloadKey

__all__ = [
    "EventQueueMixin",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
]

_T = TypeVar("_T")
_serials = itertools.count(1)


@dataclass(slots=True, eq=False)
class ReqContext:
    """One request as the offloading layer sees it.

    The scheduler creates exactly one per request and passes the *same object* on every manager
    call for that request, so managers and policies may keep per-request scratch state on it
    instead of in dicts keyed by request id that they would have to clean up:
    :meth:`setdefault_state` gets or creates it (keyed by the state's type, or by its owner),
    :meth:`pop_state` drops it; :meth:`get_state` / :meth:`set_state` read and replace by type.
    """

    req_id: str
    #: Free-form per-request parameters (store policy, token caps, ...), owned by the caller.
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    #: End-token position of each of the request's keys (vLLM's ``set_offload_key_position``),
    #: set before the key's first manager call; empty when the caller does not track them. A
    #: recency policy orders a request's keys by them (see docs/eviction-policies.md).
    offload_key_positions: dict[OffloadKey, int] = field(default_factory=dict, repr=False)
    #: A number no other context of this process has: policies count a request's use of a
    #: block once by stamping the block with it.
    serial: int = field(default_factory=_serials.__next__, repr=False)
    _state: dict[object, Any] = field(default_factory=dict, repr=False)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        """Record that ``key``'s block ends at token ``end_token`` of this request."""
        self.offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        """The end-token position recorded for ``key``, or ``None``."""
        return self.offload_key_positions.get(key)

    def get_state(self, cls: type[_T]) -> _T | None:
        """Return the scratch state of type ``cls`` attached to this request, or ``None``."""
        return self._state.get(cls)

    def set_state(self, state: object) -> None:
        """Attach ``state``, replacing any earlier state of the same type."""
        self._state[type(state)] = state

    def setdefault_state(self, key: Hashable, factory: Callable[..., _T], *args: Any) -> _T:
        """The scratch state filed under ``key``, made by ``factory(*args)`` and attached on first
        use.

        ``key`` is a state type (the state is shared by whoever uses that type, as with
        :meth:`get_state`) or an owner object (a manager or policy instance: the state is that
        instance's own, so two tiers sharing this context never read each other's).
        """
        state = self._state.get(key)
        if state is None:
            state = self._state[key] = factory(*args)
        return state

    def pop_state(self, key: Hashable) -> Any:
        """Detach and return the state filed under ``key`` (a type or an owner; ``None`` if
        there was none)."""
        return self._state.pop(key, None)


class LookupResult(enum.Enum):
    """What :meth:`OffloadingManager.lookup` knows about one block."""

    #: Not held by this tier.
    MISS = 0
    #: Stored and readable: :meth:`OffloadingManager.prepare_load` may be called for it.
    HIT = 1
    #: Being written: it becomes readable once its store completes (or vanishes if it fails).
    HIT_PENDING = 2
    #: Not known yet (an asynchronous lookup or a promotion for this request is running): ask
    #: again next step. Only tiering managers and secondary tiers answer it.
    RETRY = 3


class LoadStoreSpec(ABC):
    """Opaque "where the data is" for one transfer side. ``medium`` routes it to a handler."""

    __slots__ = ()
    medium: ClassVar[str]


@dataclass(slots=True)
class PrepareStoreOutput:
    """The answer of :meth:`OffloadingManager.prepare_store`.

    ``store_spec`` addresses the destination of ``keys_to_store``, entry for entry (co-indexed).
    ``evicted_keys`` were removed from the tier to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(slots=True, frozen=True)
class OffloadingEvent:
    """Blocks that became readable (``removed=False``) or left the tier (``removed=True``).

    ``locality`` is set by storage tiers (``"LOCAL"``, ``"REMOTE"``); ``None`` otherwise.
    """

    keys: list[OffloadKey]
    medium: str
    removed: bool
    locality: str | None = None


class EventQueueMixin:
    """``take_events`` for a manager or tier that gathers its events in ``self._events``.

    ``_events`` is a list, or ``None`` when events are off: then nothing is gathered and every
    take is empty. The owner appends :class:`OffloadingEvent` s; a take hands over the list and
    starts a new one (no copy), so each event is taken exactly once.
    """

    _events: list[OffloadingEvent] | None

    def take_events(self) -> list[OffloadingEvent]:
        events = self._events
        if not events:
            return []
        self._events = []
        return events


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one offloading tier.

    Block states: absent; *pending* (prepared for store, being written, not readable, never
    evicted); *ready* (readable); ready blocks may additionally be *pinned* by one or more readers
    between :meth:`prepare_load` and :meth:`complete_load` (never evicted while pinned).

    Every method takes the request's :class:`ReqContext`. Methods are not thread-safe: the
    scheduler calls them from its one thread. Keys passed in one call for a request are in prefix
    order within each KV-cache group (head first).
    """

    #: The medium name used in events and load/store specs (``"CPU"``, ``"STORAGE"``, ...).
    medium: str

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Say whether ``key`` is held, readable or being written. Changes no recency."""

    def holds(self, key: OffloadKey, ctx: ReqContext) -> bool:
        """Whether :meth:`prepare_store` would skip ``key``: the tier that stores go to holds it
        (readable or being written). A pure probe: no recency, no background work, no counters.
        Default: :meth:`lookup` is not ``MISS``; managers whose lookup does more (a tiering
        manager's promotions, a reuse filter's counting) override it."""
        return self.lookup(key, ctx) is not LookupResult.MISS

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` for reading and return where they are, co-indexed with ``keys``.

        Every key must be :attr:`LookupResult.HIT`; otherwise :class:`~kvoffload.errors.ContractError`
        is raised and nothing is pinned. A key listed twice is pinned twice. Each pin is released by
        one :meth:`complete_load` of the same key.
        """

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """Mark ``keys`` (prefix order) as just used: the first key ends up most valuable.

        Keys the tier does not hold are ignored. Default: no-op.
        """

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Release one pin per key taken by :meth:`prepare_load`.

        A key that is not pinned raises :class:`~kvoffload.errors.ContractError`, before any pin
        is released.
        """

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve room for the keys of ``keys`` the tier does not hold yet.

        Keys already held (in any state) are skipped; an eviction policy may decline to admit
        others. Every key of ``keys`` is protected from eviction during this call. Only as many
        blocks as needed are evicted. Returns ``None``, with no state change at all, when there
        is not enough evictable space; an output with empty ``keys_to_store`` means "nothing to
        do". Prepared keys are pending until :meth:`complete_store`.
        """

    @abstractmethod
    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish the stores of pending ``keys``: readable on success, removed on failure.

        Keys that are not pending (unknown, already ready) are ignored, so repeats are harmless.
        """

    def take_events(self) -> list[OffloadingEvent]:
        """Return and clear the events gathered since the last call (always empty when disabled)."""
        return []

    def request_finished(self, ctx: ReqContext) -> None:  # noqa: B027
        """Called once when the request ends, after its last call. Default: no-op."""

    def step_begin(self) -> None:  # noqa: B027
        """Once per engine step, before completions and lookups: apply background work that
        finished (a tiering manager's promotions and cascades). Default: no-op."""

    def step_end(self) -> None:  # noqa: B027
        """Once per engine step, after scheduling: submit background work gathered during the
        step. Default: no-op."""

    def num_background_jobs(self) -> int:
        """Background jobs (not worker transfers) still running. Default: 0."""
        return 0

    def await_promotions(self, ctx: ReqContext) -> bool:
        """``ctx``'s lookup pass answered ``RETRY``: start the step's promotions now and wait,
        within the manager's own bound, for ``ctx``'s to land. Returns whether they all
        finished, so that a new lookup pass of ``ctx`` in this step gets final answers (a disk
        hit then loads in the step it was found). Default: ``False`` (nothing to wait for)."""
        return False

    @abstractmethod
    def reset(self) -> None:
        """Drop every block, pinned or pending too, and emit removals for the readable ones.

        The caller must discard completions of transfers started before the reset.
        """

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Return monotonic counters and current gauges (names documented per manager)."""

    def load_source(self, key: OffloadKey, ctx: ReqContext) -> str:
        """The tier that supplies ``key`` to a load (``"host"``, ``"disk"``, ``"remote"``).

        Asked once per key when a load of a ``HIT`` is planned, for hit counts by source (as
        vLLM's ``get_load_source``). Composing managers override it. Default: ``"host"``.
        """
        return "host"

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """``stats()`` per tier, by tier name (``"host"`` first, then secondary tiers).

        The metrics export one series per tier from this. Composing managers override it and
        return each secondary tier's :meth:`~kvoffload.tiers.contract.SecondaryTier.stats`.
        Default: the whole manager is the host tier.
        """
        return {"host": self.stats()}
