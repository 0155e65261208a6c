"""The waiting-queue protocol the engine scheduler admits through, and the first order.

The queues speak one protocol with :class:`~kvoffload.engine.scheduler.EngineScheduler`. A
step's admission pass is :meth:`WaitingQueue.begin_pass`, then :meth:`~WaitingQueue.next_candidate`
until it answers ``None`` or the scheduler stops; each candidate is admitted
(:meth:`~WaitingQueue.take`), passed over for this step (:meth:`~WaitingQueue.defer`: tried again
next step, in its place), or left where it is (the scheduler stopped at it: no room);
:meth:`~WaitingQueue.end_pass` puts the deferred ones back.

:class:`FCFSQueue` (``scheduling_policy="fcfs"``): arrival order, preempted requests first
(vLLM's order, and its default).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from kvoffload.engine.request import Request
from kvoffload.errors import ContractError
from kvoffload.keys import BlockHash

__all__ = ["FCFSQueue", "HeldProbe", "HeldWorth", "WaitingQueue"]

#: ``(request, first, end)`` -> how many of its blocks ``first, first+1, ...`` (``< end``), a
#: leading run, the host tier holds. A pure probe (the connector's ``num_held_blocks``).
HeldProbe = Callable[[Request, int, int], int]
#: What a block the host tier holds saves when admitted, as a share of a device-resident block's
#: saving, in ``[0, 1]`` (0: it would not be loaded). Read once per admission pass.
HeldWorth = Callable[[], float]


class WaitingQueue:
    """The waiting requests and the order an admission pass tries them in (module docstring).

    Hooks the scheduler calls for every policy (no-ops here): :meth:`admitted`,
    :meth:`blocks_cached`, :meth:`released`, :meth:`shares_in_flight`.
    """

    def add(self, req: Request) -> None:
        raise NotImplementedError

    def add_preempted(self, req: Request) -> None:
        raise NotImplementedError

    def remove(self, req: Request) -> None:
        """Drop a waiting request (aborted); outside a pass."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def __contains__(self, req: object) -> bool:
        raise NotImplementedError

    def begin_pass(self) -> None:
        raise NotImplementedError

    def next_candidate(self) -> Request | None:
        raise NotImplementedError

    def take(self, req: Request) -> None:
        """``req``, the last candidate, is admitted."""
        raise NotImplementedError

    def defer(self, req: Request) -> None:
        """``req``, the last candidate, is passed over for this step."""
        raise NotImplementedError

    def end_pass(self) -> None:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Check the queue's structures, between passes (a test and debug hook, ``O(n)``);
        raises :class:`~kvoffload.errors.ContractError` naming a broken invariant."""
        raise NotImplementedError

    def admitted(self, req: Request, num_hit_blocks: int) -> None:
        """``req`` got its blocks; its prompt blocks after the first ``num_hit_blocks`` (engine
        prefix-cache hits) are computed or loaded from now on."""

    def blocks_cached(self, req: Request, num_cached_blocks: int, hashes: list[BlockHash]) -> None:
        """``req``'s first ``num_cached_blocks`` blocks are in the prefix cache; ``hashes`` just
        entered it."""

    def released(self, req: Request) -> None:
        """``req`` left the running set (finished, aborted or preempted)."""

    def shares_in_flight(self, req: Request, num_hit_blocks: int) -> bool:
        """Whether the last candidate should wait a step for blocks another request computes."""
        return False


class FCFSQueue(WaitingQueue):
    """Arrival order; a preempted request goes to the front (vLLM's order)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._deferred: list[Request] = []

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def add_preempted(self, req: Request) -> None:
        self._queue.appendleft(req)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, req: object) -> bool:
        return req in self._queue

    def begin_pass(self) -> None:
        self._deferred = []

    def next_candidate(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def take(self, req: Request) -> None:
        self._check_candidate(req)
        self._queue.popleft()

    def defer(self, req: Request) -> None:
        self._check_candidate(req)
        self._deferred.append(self._queue.popleft())

    def _check_candidate(self, req: Request) -> None:
        if not self._queue or self._queue[0] is not req:
            raise ContractError(f"request {req.request_id} is not the last candidate")

    def end_pass(self) -> None:
        self._queue.extendleft(reversed(self._deferred))
        self._deferred = []

    def check_invariants(self) -> None:
        """Between passes nothing is deferred, and each waiting request is queued once."""
        if self._deferred:
            raise ContractError("FCFSQueue invariant broken: deferred requests left after a pass")
        if len({id(r) for r in self._queue}) != len(self._queue):
            raise ContractError("FCFSQueue invariant broken: a request is queued twice")
