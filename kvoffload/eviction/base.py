"""The eviction-policy interface, the block record it orders, and the policy registry.

The manager owns accounting (capacity, slots, pins, events); a policy owns only *order*: which
evictable block goes next. Policies are small classes over :class:`EvictionPolicy`, registered by
name with :func:`register_eviction_policy`; out-of-tree policies register through the
``kvoffload.eviction_policies`` entry-point group (``name = "package.module:Class"``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence
from importlib.metadata import entry_points
from typing import Any, ClassVar, TypeVar

from kvoffload.errors import ConfigError
from kvoffload.eviction._request_state import RequestUses
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = [
    "ENTRY_POINT_GROUP",
    "EvictionPolicy",
    "HeldBlocksPolicy",
    "OffloadedBlock",
    "available_eviction_policies",
    "create_eviction_policy",
    "overrides",
    "register_eviction_policy",
    "requeue_tail_first",
    "restore_unpinned",
    "take_pinned",
]

ENTRY_POINT_GROUP = "kvoffload.eviction_policies"

#: ``ref_cnt`` of a block that is being written (prepared, store not completed).
PENDING = -1


class OffloadedBlock:
    """One offloaded block: its slot in the tier, its pin count, and two fields of its policy.

    ``ref_cnt``: ``-1`` pending (being written: unreadable, not evictable); ``0`` ready and
    evictable; ``n > 0`` ready and pinned by ``n`` in-flight loads. Only the manager mutates it.
    ``freq`` (a use count) and ``user`` (the :attr:`~kvoffload.manager_contract.ReqContext.serial` of the
    last request that used it, so that a request's use counts once) belong to the eviction
    policy holding the block, which sets them on insert: one lookup per use instead of a second
    table. The manager never reads them, and a record is held by one policy at a time. A record
    belongs to its block only while the policy holds it: the manager reuses the record of an
    evicted or failed block for a later one.
    """

    __slots__ = ("freq", "ref_cnt", "slot", "user")

    def __init__(self, slot: int, ref_cnt: int = PENDING) -> None:
        self.slot = slot
        self.ref_cnt = ref_cnt
        self.freq = 0
        self.user = 0

    def __repr__(self) -> str:
        return f"OffloadedBlock(slot={self.slot}, ref_cnt={self.ref_cnt})"


class EvictionPolicy(ABC):
    """Orders the blocks of one tier for eviction.

    Subclasses must implement :meth:`get`, :meth:`insert`, :meth:`remove`, :meth:`touch`,
    :meth:`evict`, :meth:`clear`, :meth:`__len__` and :meth:`__iter__`; they may override
    :meth:`insert_n` (a batch of inserts in one call), :meth:`admit` (admission control), the
    request hooks :meth:`store_missed`, :meth:`request_accessed` and :meth:`request_finished`
    (vLLM 0.33's ``on_store_miss``, ``on_request_access`` and ``on_request_finished``), and
    :meth:`check_invariants`. The manager calls an optional hook only if the policy overrides it.

    A block is *evictable* when its ``ref_cnt == 0`` and its key is not in the ``protected``
    container passed to :meth:`evict`. ``generation`` counts :meth:`clear` calls: per-request
    state a policy keeps on a ``ReqContext`` is valid only in the generation it was made in.
    Not thread-safe.
    """

    #: The registry name (``--eviction-policy``).
    name: ClassVar[str]
    #: Whether :meth:`request_finished` reads ``uses``, the request's access as vLLM's manager
    #: records it. Managers record it only for policies that do; the others get an empty one.
    reads_access: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.generation = 0

    @abstractmethod
    def get(self, key: OffloadKey) -> OffloadedBlock | None:
        """Return the block of ``key`` or ``None``. Must not change any order."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: OffloadedBlock, ctx: ReqContext | None = None) -> None:
        """Add a block the policy does not hold (just prepared for store), stored by the request
        of ``ctx`` (``None``: by no request, e.g. found on disk at start)."""

    def insert_n(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[OffloadedBlock],
        ctx: ReqContext | None = None,
    ) -> None:
        """Insert ``blocks[i]`` under ``keys[i]``, in order: the same as calling :meth:`insert`
        for each (the manager's one call per stored run; override to save a call per block)."""
        insert = self.insert
        for key, block in zip(keys, blocks, strict=True):
            insert(key, block, ctx)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a held block (its store failed). Not an eviction."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Record a use of ``keys`` (prefix order, head first). Unknown keys are ignored."""

    @abstractmethod
    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        """Remove and return exactly ``n`` evictable blocks, or return ``None`` and change nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every block (and bump :attr:`generation`)."""

    @abstractmethod
    def __len__(self) -> int:
        """The number of blocks held."""

    @abstractmethod
    def __iter__(self) -> Iterator[OffloadKey]:
        """Iterate over held keys (any order)."""

    def admit(
        self, keys: list[OffloadKey], chain: Sequence[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey]:
        """Return the subset of ``keys`` (absent, to be stored) worth storing, in order.

        ``chain`` is everything the caller offered (prefix order), ``keys`` the absent part of it.
        Default: admit all.
        """
        return keys

    def store_missed(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """``keys`` (absent, admitted) are about to be stored for the request of ``ctx``: called
        before the eviction that makes room for them, even when it then fails, with the keys
        that were no store miss of the request before (the manager counts a store miss once per
        request and key, as vLLM's). Default: nothing."""

    def request_accessed(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """The request of ``ctx``, whose context carries key positions, loads ``keys`` or offers
        them to store (a run of :class:`~kvoffload.eviction._request_state.RequestUses`; some
        may not be held, some may repeat earlier runs). Called only for requests with positions:
        without them a first access tells a policy nothing that :meth:`request_finished` does
        not. Default: nothing."""

    def request_finished(self, uses: RequestUses, ctx: ReqContext) -> None:  # noqa: B027
        """The request of ``ctx`` ended: commit its use of the keys it loaded, offered to store
        or touched (``uses``: what the manager recorded, when :attr:`reads_access`; some keys may
        no longer be held). A policy where order matters arranges them so that, within the
        chain, the tail leaves first and the head last. Default: nothing."""

    def pinned(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027
        """Operator pins (:mod:`kvoffload.managers.pins`) now hold ``keys`` (held and ready, each
        referenced: not evictable until :meth:`unpinned`), for long. A policy may take them out
        of the way of its eviction scan. Default: nothing (the scan passes over them, as over
        blocks being read)."""

    def unpinned(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027
        """The last operator pin of ``keys`` is gone (see :meth:`pinned`). Default: nothing."""

    def check_invariants(self) -> None:  # noqa: B027 - optional hook
        """Raise ``AssertionError`` if internal structures disagree (tests only)."""


class HeldBlocksPolicy(EvictionPolicy):
    """A policy whose held blocks live in one dict, ``_blocks`` (key -> record), besides its own
    order: :meth:`get` (one C call: it runs once per block per lookup), ``len`` and iteration
    come from it. Subclasses keep ``_blocks`` in step with their lists."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: dict[OffloadKey, OffloadedBlock] = {}
        # A bound C method; dict.get's overloads are not get()'s signature (mypy sees both).
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]

    def get(self, key: OffloadKey) -> OffloadedBlock | None:  # replaced per instance in __init__
        return self._blocks.get(key)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._blocks)


def requeue_tail_first(queue: OrderedDict[Any, Any], keys: Sequence[OffloadKey]) -> None:
    """Move each key of ``keys`` that ``queue`` holds to its new end, tail first, so that the
    head of the chain ends newest (the loop of every recency update)."""
    move = queue.move_to_end
    for key in reversed(keys):
        if key in queue:  # a membership test: cheaper than catching KeyError for absent keys
            move(key)


def take_pinned(
    keys: Sequence[OffloadKey],
    first: OrderedDict[OffloadKey, OffloadedBlock],
    second: OrderedDict[OffloadKey, OffloadedBlock],
    pinned: dict[OffloadKey, bool],
) -> None:
    """Operator pins of a two-queue policy: each key held in ``first`` or ``second`` leaves it
    (so no eviction scan passes it) and ``pinned`` records whether it came from ``second``. O(1)
    per key; keys in neither queue (pinned already, or not held) are left alone."""
    for key in keys:
        if first.pop(key, None) is not None:
            pinned[key] = False
        elif second.pop(key, None) is not None:
            pinned[key] = True


def restore_unpinned(
    keys: Sequence[OffloadKey],
    blocks: dict[OffloadKey, OffloadedBlock],
    first: OrderedDict[OffloadKey, OffloadedBlock],
    second: OrderedDict[OffloadKey, OffloadedBlock],
    pinned: dict[OffloadKey, bool],
) -> None:
    """Undo :func:`take_pinned`: each key ``pinned`` records, still held (in ``blocks``), goes
    back to the new end of the queue it came from. O(1) per key."""
    for key in keys:
        from_second = pinned.pop(key, None)
        block = blocks.get(key)
        if from_second is not None and block is not None:
            (second if from_second else first)[key] = block


def overrides(policy: EvictionPolicy, hook: str) -> bool:
    """Whether ``policy``'s class overrides the optional hook ``hook`` of :class:`EvictionPolicy`
    (a manager calls the hooks a policy leaves alone not at all: chosen once, not per call)."""
    return getattr(type(policy), hook) is not getattr(EvictionPolicy, hook)


_P = TypeVar("_P", bound=type[EvictionPolicy])
_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_eviction_policy(cls: _P) -> _P:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(
            f"eviction policy name {cls.name!r} is already registered by {_REGISTRY[cls.name]!r}"
        )
    _REGISTRY[cls.name] = cls
    return cls


def _load_entry_point(name: str) -> type[EvictionPolicy] | None:
    """Load (once) the out-of-tree policy registered under ``name``; other plugins stay unloaded,
    so one broken plugin never hides the rest."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            cls = ep.load()
        except Exception as exc:
            raise ConfigError(
                "eviction_policy", f"entry point {name!r} ({ep.value}) failed to load: {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
            raise ConfigError(
                "eviction_policy", f"entry point {ep.value!r} is not an EvictionPolicy subclass"
            )
        _REGISTRY[name] = cls
        return cls
    return None


def available_eviction_policies() -> list[str]:
    """Names of every registered policy, out-of-tree entry points included (not loaded)."""
    return sorted({*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def create_eviction_policy(name: str, capacity: int) -> EvictionPolicy:
    """Instantiate the policy registered as ``name`` for a tier of ``capacity`` blocks."""
    cls = _REGISTRY.get(name) or _load_entry_point(name)
    if cls is None:
        raise ConfigError(
            "eviction_policy",
            f"unknown policy {name!r}; choose from {available_eviction_policies()}",
        )
    return cls(capacity)
