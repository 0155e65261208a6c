"""The secondary-tier contract: :class:`SecondaryTier` and its job types.

A secondary tier holds whole offloaded blocks by :data:`~kvoffload.keys.OffloadKey`, outside the
device and outside the host pool. It reads and writes the host pool only, through the
``memoryview`` it is built with (2-D, ``(num_slots, slot_bytes)``; ``pool.strides[0]`` is the
slot size; slot ``s`` is ``pool.cast("B")[s * B:(s + 1) * B]``, since a 2-D memoryview has no
row sub-views), as vLLM 0.33's ``SecondaryTierManager`` reads vLLM's CPU pool.

Calls come from the scheduler's one thread and must never block on I/O:

* :meth:`SecondaryTier.lookup` answers from what the tier already knows. A key whose answer is not
  known yet (a lookup still running on a background thread) is
  :attr:`~kvoffload.manager_contract.LookupResult.RETRY`; asking starts that background lookup, and a later
  call answers ``HIT`` or ``MISS``. A key being written by this tier is ``HIT_PENDING``.
* :meth:`SecondaryTier.submit_store` / :meth:`SecondaryTier.submit_load` queue a job and return at
  once; the bytes move on the tier's own threads; :meth:`SecondaryTier.get_finished_jobs` reports
  each job exactly once. A tier notifies its :attr:`SecondaryTier.result_signal` (any thread)
  whenever a result becomes ready to report, so a waiter sleeps until then instead of polling.

Invariants (``docs/tiers.md``; checked by the tier state machine tests):

1. A block is readable (``HIT``, served by a load) only after its write completed in full.
2. A load never returns bytes other than those stored under its key for this :class:`KVLayout`:
   a missing, truncated, corrupt or foreign-layout block fails the load (the key is listed in
   :attr:`TierJobResult.failed_keys` with a cause) and is dropped from the tier.
3. The caller keeps a job's host slots untouched (pinned) until the job is reported finished;
   the tier touches those slots only between submit and report.
4. The tier never holds more than its capacity; it evicts by its eviction policy and never evicts
   a block that a submitted load is reading.
5. Every submitted job is reported exactly once, also on failure, :meth:`drain_jobs` and
   :meth:`close`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import xxhash

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, OffloadingEvent, ReqContext

__all__ = ["KVLayout", "ResultSignal", "SecondaryTier", "TierJob", "TierJobResult"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the bytes of one offloaded block mean; blocks of another layout are never served.

    ``block_bytes`` is the size of one offloaded block (one host slot). :meth:`fingerprint` is
    stored in every block's header and namespaces shared stores, so two models never exchange
    blocks.
    """

    model: str
    dtype: str
    tokens_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int

    def fingerprint(self) -> bytes:
        """16 bytes that differ between any two layouts (xxh3-128 of the fields, in order)."""
        text = "|".join(
            str(v)
            for v in (
                self.model,
                self.dtype,
                self.tokens_per_block,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.block_bytes,
            )
        )
        return xxhash.xxh3_128_digest(text.encode())


@dataclass(slots=True)
class TierJob:
    """One store (host slots → tier) or load (tier → host slots) of ``keys``.

    ``slots[i]`` is the host-pool slot of ``keys[i]``. Job ids are unique per tiering manager.
    """

    job_id: int
    keys: list[OffloadKey]
    slots: list[int]


@dataclass(slots=True)
class TierJobResult:
    """The outcome of one job, reported once by :meth:`SecondaryTier.get_finished_jobs`.

    ``failed_keys`` maps each key that was not stored (store) or not loaded (load) to its cause:
    ``"missing"`` (vanished or never there), ``"checksum"``, ``"layout"`` (another model's block),
    ``"corrupt"`` (bad header or length), ``"io"`` (an OS or network error), ``"timeout"``,
    ``"full"`` (no room). A load's other keys hold exactly their stored bytes in their slots.
    ``success`` is True when ``failed_keys`` is empty.
    """

    job_id: int
    is_store: bool
    failed_keys: dict[OffloadKey, str] = field(default_factory=dict)
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        return not self.failed_keys


class ResultSignal:
    """How many tier results were made ready so far, and a wait for more: a tier calls
    :meth:`notify` (from any thread) once a job's result is ready for
    :meth:`SecondaryTier.get_finished_jobs`; a waiter reads :attr:`count`, takes the results,
    then waits past that count (:meth:`wait_past`), so a result made ready in between is never
    slept through."""

    __slots__ = ("_changed", "_count")

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def notify(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def wait_past(self, seen: int, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for :attr:`count` to differ from ``seen``; whether
        it does."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count != seen, timeout)


class SecondaryTier(ABC):
    """One tier behind the host tier (see the module docstring for the contract).

    ``name`` labels the tier in stats, metrics and per-request tier selection (``"disk"``,
    ``"remote"``). Events use ``medium`` ``"STORAGE"`` and :attr:`locality` (``"LOCAL"`` for
    storage of this node, ``"REMOTE"`` for storage every node reaches).
    """

    medium: ClassVar[str] = "STORAGE"
    locality: ClassVar[str] = "LOCAL"
    name: ClassVar[str]

    def __init__(self, pool: memoryview, layout: KVLayout) -> None:
        if pool.ndim != 2 or not pool.strides or pool.strides[0] != layout.block_bytes:
            raise ValueError(
                f"the host pool view must be 2-D with {layout.block_bytes}-byte rows, "
                f"got shape {pool.shape}"
            )
        self.pool = pool
        self.layout = layout
        #: Notified whenever a result becomes ready to report (:meth:`set_result_signal`).
        self.result_signal = ResultSignal()

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``HIT``, ``MISS``, ``HIT_PENDING`` (being written) or ``RETRY`` (not known yet)."""

    def holds(self, key: OffloadKey, ctx: ReqContext) -> bool:
        """Whether the tier knows, without asking anyone (no I/O, no question queued), that it
        holds ``key`` or is writing it. A cascade asks this before storing. Default: ``lookup``
        is ``HIT`` or ``HIT_PENDING`` (for tiers whose lookup answers from what they know)."""
        return self.lookup(key, ctx) in (LookupResult.HIT, LookupResult.HIT_PENDING)

    @abstractmethod
    def submit_store(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        """Queue writing ``job``'s slots under its keys; keys already held are skipped
        (reported as stored). Evicts by policy to make room; no room is ``"full"``."""

    @abstractmethod
    def submit_load(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        """Queue reading ``job``'s keys into its slots. The keys were ``HIT``; the tier keeps
        them from eviction until the job is reported."""

    @abstractmethod
    def get_finished_jobs(self) -> list[TierJobResult]:
        """Jobs finished since the last call, each reported exactly once. Never blocks."""

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job finished; their results are still reported by
        :meth:`get_finished_jobs`. Never aborts a copy halfway."""

    def set_result_signal(self, signal: ResultSignal) -> None:
        """Notify ``signal`` from now on (a manager waiting on several tiers gives each the
        same one). A tier that keeps its own reference to the signal overrides this too."""
        self.result_signal = signal

    def wait_for_answers(self) -> None:  # noqa: B027
        """Wait, at most for the tier's own bound, for the answers to the lookups it answered
        ``RETRY`` so far (a server being asked), so that they can be asked again within the same
        engine step. Never waits on a dead or slow server beyond that bound. Default: no-op
        (tiers whose lookups answer at once)."""

    def forget_misses(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027
        """Forget the misses of ``keys`` the tier believes for a while (so that the next
        :meth:`lookup` asks again: an operator's lookup wants the answer of now). Default: no-op
        (tiers whose lookups answer from what they hold)."""

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """Mark ``keys`` (prefix order) as just used. Unknown keys are ignored. Default: no-op."""

    def request_finished(self, ctx: ReqContext) -> None:  # noqa: B027
        """The request will make no more calls: drop its per-request state. Default: no-op."""

    def take_events(self) -> list[OffloadingEvent]:
        """Blocks that became readable or left this tier since the last call."""
        return []

    def reset(self) -> None:  # noqa: B027
        """Forget every block (the engine's KV became invalid); finishes jobs in flight first.
        Default: no-op (for tiers whose blocks stay valid)."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters and gauges: at least ``capacity_bytes``, ``used_bytes``, ``used_blocks``,
        ``stored_blocks``, ``loaded_blocks``, ``evicted_blocks``, ``failed_load_blocks``,
        ``failed_store_blocks``; failures also per cause as ``failed_load_<cause>``."""

    def close(self) -> None:  # noqa: B027
        """Finish or fail every job, stop threads, release connections. Idempotent."""
