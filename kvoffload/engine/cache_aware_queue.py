"""The cache-aware waiting queue: its order, kept by events, and its bound on unfairness.

:class:`CacheAwareQueue` (``"cache_aware"``, the default): SGLang's longest-prefix-match order
(``lpm``, long SGLang's default), with aging, kept by events rather than rescans. A request's
*score* is the leading run of its prompt blocks that are *resident*: in the device prefix cache,
being computed or loaded by an admitted request, or held by the host tier (the offloading
connector's pure probe). Requests are tried preempted first, then by *rank*, lowest first (ties in
arrival order), a pair compared in order::

    rank = (-device-resident blocks of the run, age - worth x host-held blocks of the run)

* Device-resident blocks first (pure longest-prefix order where nothing is held, as without
  offloading): they are free to use and volatile (any admission may evict them), so requests
  that share them run together, before they go.
* Then host-held blocks, aged. ``worth`` (:data:`~kvoffload.engine.waiting_queue.HeldWorth`, read
  once per pass): what a held block saves as a share of a device-resident one, by the
  connector's ``load_policy`` and cost estimates (0 where it would not be loaded: it then counts
  for nothing). ``age``: the prompt blocks of all requests admitted from the queue before this
  one arrived (a clock that runs with admitted work). Held blocks keep (the host tier is far
  larger), so a request passes an older one on them only by a held lead larger than the prompts
  admitted between their arrivals: requests that arrive together are in longest-held-prefix
  order, while a warm chat turn that arrives later no longer jumps every cold turn that has
  waited through admissions (issue 28: other users' round-1 turns 0.54x and P99 0.55x against
  no offloading).

The rank is fixed at arrival but for the score and ``worth``: one heap push per change.
Scores only rise by events: each waiting request is filed under its *frontier* (the hash of its
first non-resident block), and a block entering the device cache or an admission's in-flight set
advances the requests filed under it (``O(blocks that changed)`` per step, no rescan of the queue).
A score that fell (blocks evicted) or a rank made with another ``worth`` is corrected when the
request comes up: its run is re-walked then, once per pass. A request whose first non-cached block an admitted request is computing right
now is passed over for this step (in-batch prefix sharing: once cached, it is a hit; admitted now,
the request would compute it a second time).

Bounded unfairness: no waiting request sees more than ``max_bypass`` requests that arrived after
it admitted before it. The oldest waiting request has been passed over at least as often as any
other (it waited through every admission the others did), so only its count is kept: the tickets
of requests admitted past it, in a heap (``O(log n)`` per admission). Once it reaches
``max_bypass``, it is the only candidate until admitted: the pass stops at it when it does not
fit or waits for its blocks (a load it shares, a promotion). Re-admissions of preempted
requests (which go first, as under FCFS) are not counted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from typing import Any

from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request
from kvoffload.engine.waiting_queue import HeldProbe, HeldWorth, WaitingQueue
from kvoffload.errors import ContractError
from kvoffload.keys import BlockHash

__all__ = ["CacheAwareQueue"]


class _Entry:
    """A waiting request of a :class:`CacheAwareQueue`: arrival ticket, the most blocks that can
    be hits (``limit``: never the last prompt token), its age, score and rank (module docstring),
    whether it still waits, and the frontier hash it is filed under (``None``: not filed)."""

    __slots__ = ("age", "filed", "limit", "live", "rank", "req", "score", "ticket", "walked")

    def __init__(self, req: Request, ticket: int, limit: int, age: int) -> None:
        self.req = req
        self.ticket = ticket
        self.limit = limit
        self.age = age
        self.score = 0
        self.rank: tuple[int, float] = (0, age)
        self.live = True
        self.walked = -1  # the pass that last re-walked its run
        self.filed: BlockHash | None = None


class CacheAwareQueue(WaitingQueue):
    """Longest resident prefix first, with at most ``max_bypass`` later arrivals admitted before
    any waiting request (module docstring). ``held``: the host tier's probe, if offloading."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_bypass: int,
        held: HeldProbe | None = None,
        held_worth: HeldWorth | None = None,
    ) -> None:
        self._held_worth = held_worth
        self._held_weight = 1.0
        self._read_worth()
        #: prompt blocks of every request admitted from the queue so far (the age clock)
        self._admitted_blocks = 0
        self._pool = pool
        self._block_size = block_size
        self._max_bypass = max_bypass
        self._held = held
        self._caching = pool.enable_caching
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # arrival order
        self._preempted: deque[Request] = deque()
        #: (rank, ticket, push number, entry) of every waiting entry; stale items (rank changed,
        #: taken, aborted) are skipped when popped
        self._heap: list[tuple[tuple[int, float], int, int, _Entry]] = []
        self._pushes = itertools.count()
        #: frontier hash -> the entries filed under it, by ticket
        self._frontier: dict[BlockHash, dict[int, _Entry]] = {}
        #: prompt blocks admitted requests compute or load now (count of requests), and per
        #: request the range of its blocks still counted there
        self._in_flight: dict[BlockHash, int] = {}
        self._flight_ranges: dict[str, tuple[Request, int, int]] = {}
        #: tickets of requests admitted past the oldest waiting one (min-heap; older ones pruned)
        self._passed: list[int] = []
        self._tickets = itertools.count()
        self._passes = itertools.count()
        # The current pass.
        self._pass = -1
        self._tried: set[str] = set()
        self._tried_entries: list[_Entry] = []
        self._taken: list[_Entry] = []
        self._deferred_preempted: list[Request] = []
        self._current: _Entry | Request | None = None
        self._urgent = False
        self._stopped = False

    # ------------------------------------------------------------------ membership

    def add(self, req: Request) -> None:
        limit = (req.num_tokens - 1) // self._block_size
        entry = _Entry(req, next(self._tickets), limit, self._admitted_blocks)
        self._entries[req.request_id] = entry
        self._set_score(entry, *self._walk(entry, 0))

    def add_preempted(self, req: Request) -> None:
        self._preempted.appendleft(req)

    def remove(self, req: Request) -> None:
        entry = self._entries.pop(req.request_id, None)
        if entry is None:
            self._preempted.remove(req)
            return
        entry.live = False
        self._unfile(entry)  # its filing is under a hash that may never become resident

    def __len__(self) -> int:
        return len(self._entries) + len(self._preempted)

    def __iter__(self) -> Iterator[Request]:
        yield from self._preempted
        yield from (e.req for e in self._entries.values() if e.live)

    def __contains__(self, req: object) -> bool:
        entry = self._entries.get(getattr(req, "request_id", ""))
        if entry is not None:
            return entry.live and entry.req is req
        return req in self._preempted

    def check_invariants(self) -> None:
        """Check the queue's structures against each other, between passes (a test and debug
        hook: ``O(waiting + in-flight blocks)``). Raises :class:`~kvoffload.errors.ContractError`
        naming the first broken one:

        1. ``_entries`` holds the waiting requests in arrival (ticket) order, keyed by request id,
           all live; no pass state is left (``_tried``, ``_taken``, deferred lists empty).
        2. ``_preempted`` holds distinct requests, none of them in ``_entries``.
        3. Every entry's score is within ``0..limit``; an entry with ``score < limit`` is filed
           under ``block_hashes[score]`` (``entry.filed``), one at ``limit`` is not filed.
        4. ``_frontier`` holds exactly those filings: every entry in it is waiting and filed
           under that hash (an aborted or admitted request leaves no filing); no empty lists.
        5. Every entry has a current item ``(rank, ticket, _, entry)`` in ``_heap``, and
           ``_heap`` is a heap (stale items of other ranks may remain); every rank is
           ``(-device, held part)`` with ``0 <= device <= score`` and the held part within
           ``age - (score - device) .. age`` (``worth`` in ``[0, 1]``).
        6. ``_in_flight`` counts, per hash, the ``_flight_ranges`` that cover it (no zeros).
        7. ``_passed`` is a min-heap of tickets.
        """

        def check(ok: bool, what: str) -> None:
            if not ok:
                raise ContractError(f"CacheAwareQueue invariant broken: {what}")

        entries = list(self._entries.values())
        check(all(rid == e.req.request_id for rid, e in self._entries.items()), "1: entries keyed")
        check(all(e.live for e in entries), "1: every entry waits")
        check(all(a.ticket < b.ticket for a, b in itertools.pairwise(entries)), "1: arrival order")
        check(
            not (self._tried or self._tried_entries or self._taken or self._deferred_preempted),
            "1: no pass state left between passes",
        )
        preempted_ids = [r.request_id for r in self._preempted]
        check(len(set(preempted_ids)) == len(preempted_ids), "2: preempted requests distinct")
        check(not set(preempted_ids) & self._entries.keys(), "2: preempted ones not in entries")
        filed = 0
        for e in entries:
            check(0 <= e.score <= e.limit, f"3: {e.req.request_id} score {e.score} in 0..limit")
            want = e.req.block_hashes[e.score] if e.score < e.limit else None
            check(e.filed == want, f"3: {e.req.request_id} filed under its frontier")
            if want is not None:
                filed += 1
                check(self._frontier.get(want, {}).get(e.ticket) is e, "4: filing recorded")
        check(all(self._frontier.values()), "4: no empty filing")
        check(sum(map(len, self._frontier.values())) == filed, "4: no stale filing")
        current = {(rank, e.ticket) for rank, _, _, e in self._heap if e.rank == rank}
        check(all((e.rank, e.ticket) in current for e in entries), "5: every entry in the heap")
        check(
            all(
                -e.score <= e.rank[0] <= 0 and e.age - e.score - e.rank[0] <= e.rank[1] <= e.age
                for e in entries
            ),
            "5: ranks within bounds",
        )
        check(_is_heap(self._heap), "5: heap order")
        counts: dict[BlockHash, int] = {}
        for rid, (req, first, end) in self._flight_ranges.items():
            check(rid == req.request_id and 0 <= first <= end, f"6: flight range of {rid}")
            for h in req.block_hashes[first:end]:
                counts[h] = counts.get(h, 0) + 1
        check(counts == self._in_flight, "6: in-flight counts match the ranges")
        check(_is_heap(self._passed), "7: passed tickets a heap")

    # ------------------------------------------------------------------ a pass

    def begin_pass(self) -> None:
        self._pass = next(self._passes)
        self._read_worth()  # ranks made with another worth are re-made as they pop
        self._stopped = False

    def _read_worth(self) -> None:
        if self._held_worth is not None:
            self._held_weight = min(1.0, max(0.0, self._held_worth()))

    def next_candidate(self) -> Request | None:
        self._current, self._urgent = None, False
        if self._stopped:
            return None
        if self._preempted:
            self._current = self._preempted[0]
            return self._current
        front = self._front()
        if front is None:
            return None
        if self._num_passed(front) >= self._max_bypass:
            self._current, self._urgent = front, True
            return self._try(front)
        entry = self._pop_scored()
        if entry is None:
            return None
        self._current = entry
        return self._try(entry)

    def take(self, req: Request) -> None:
        current = self._current
        self._check_candidate(req)
        if isinstance(current, Request):
            self._preempted.popleft()
            return
        if current is None:  # _check_candidate rules it out; narrows the type
            raise ContractError(f"request {req.request_id} is not the last candidate")
        front = self._front()
        if front is not None and front is not current:
            heapq.heappush(self._passed, current.ticket)
        current.live = False
        self._admitted_blocks += current.limit
        self._unfile(current)
        self._taken.append(current)

    def defer(self, req: Request) -> None:
        current = self._current
        self._check_candidate(req)
        if isinstance(current, Request):
            self._deferred_preempted.append(self._preempted.popleft())
        elif self._urgent:
            self._stopped = True  # nothing is admitted past a request at its bound

    def end_pass(self) -> None:
        for entry in self._taken:
            del self._entries[entry.req.request_id]
        self._preempted.extendleft(reversed(self._deferred_preempted))
        for entry in self._tried_entries:
            if entry.live:
                self._push(entry)
        self._tried.clear()
        self._tried_entries.clear()
        self._taken.clear()
        self._deferred_preempted.clear()
        self._current = None
        if len(self._heap) > 2 * len(self._entries) + 64:  # mostly stale: rebuild
            pushes = self._pushes
            self._heap = [
                (e.rank, e.ticket, next(pushes), e) for e in self._entries.values()
            ]
            heapq.heapify(self._heap)

    def _check_candidate(self, req: Request) -> None:
        current = self._current
        if isinstance(current, Request):
            ok = current is req and bool(self._preempted) and self._preempted[0] is req
        else:
            ok = current is not None and current.req is req
        if not ok:
            raise ContractError(f"request {req.request_id} is not the last candidate")

    def _try(self, entry: _Entry) -> Request:
        self._tried.add(entry.req.request_id)
        self._tried_entries.append(entry)
        return entry.req

    def _front(self) -> _Entry | None:
        """The oldest waiting request (skips those taken this pass: ``O(admitted)``)."""
        for entry in self._entries.values():
            if entry.live:
                return entry
        return None

    def _num_passed(self, front: _Entry) -> int:
        """Requests that arrived after ``front`` and were admitted before it."""
        passed = self._passed
        while passed and passed[0] < front.ticket:
            heapq.heappop(passed)
        return len(passed)

    def _pop_scored(self) -> _Entry | None:
        """The untried request of the lowest rank (re-walked once per pass: a score that fell
        or a rank made with another ``worth`` is corrected and the request re-filed)."""
        heap, tried = self._heap, self._tried
        while heap:
            rank, _, _, entry = heapq.heappop(heap)
            if not entry.live or rank != entry.rank or entry.req.request_id in tried:
                continue
            if entry.walked != self._pass:
                entry.walked = self._pass
                score, held = self._walk(entry, 0)
                if score != entry.score or self._rank(entry, score, held) != rank:
                    self._set_score(entry, score, held)
                    if entry.rank > rank:
                        continue  # comes up again in its place
            return entry
        return None

    # ------------------------------------------------------------------ scores

    def _walk(self, entry: _Entry, start: int) -> tuple[int, int]:
        """The end of ``entry``'s run of resident blocks from ``start`` (``start`` resident),
        and how many of them the host tier holds (the run's tail)."""
        hashes, limit, i = entry.req.block_hashes, entry.limit, start
        if self._caching:
            in_flight, cached = self._in_flight, self._pool.is_cached
            while i < limit and (hashes[i] in in_flight or cached(hashes[i])):
                i += 1
        held = 0
        if i < limit and self._held is not None:
            held = self._held(entry.req, i, limit)
        return i + held, held

    def _rank(self, entry: _Entry, score: int, held: int) -> tuple[int, float]:
        """``entry``'s rank with a run of ``score`` blocks, the last ``held`` of them host-held."""
        return held - score, entry.age - self._held_weight * held

    def _set_score(self, entry: _Entry, score: int, held: int) -> None:
        """Record ``score`` (its last ``held`` blocks host-held) and the rank: file the entry
        under its frontier (only there), and in the heap."""
        self._unfile(entry)
        entry.score = score
        entry.rank = self._rank(entry, score, held)
        if score < entry.limit:
            frontier = entry.filed = entry.req.block_hashes[score]
            self._frontier.setdefault(frontier, {})[entry.ticket] = entry
        self._push(entry)

    def _unfile(self, entry: _Entry) -> None:
        """Take ``entry`` out of its frontier filing, if any."""
        frontier = entry.filed
        if frontier is None:
            return
        entry.filed = None
        waiters = self._frontier.get(frontier)
        if waiters is not None:
            waiters.pop(entry.ticket, None)
            if not waiters:
                del self._frontier[frontier]

    def _push(self, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.rank, entry.ticket, next(self._pushes), entry))

    def _became_resident(self, block_hash: BlockHash) -> None:
        """Advance the waiting requests whose frontier is ``block_hash``."""
        waiters = self._frontier.pop(block_hash, None)
        if not waiters:
            return
        for entry in waiters.values():
            entry.filed = None  # the filing was just popped
            self._set_score(entry, *self._walk(entry, entry.score + 1))

    # ------------------------------------------------------------------ scheduler hooks

    def admitted(self, req: Request, num_hit_blocks: int) -> None:
        if not self._caching:
            return
        hashes = req.block_hashes
        end = len(hashes)
        self._flight_ranges[req.request_id] = (req, num_hit_blocks, end)
        in_flight = self._in_flight
        for h in hashes[num_hit_blocks:end]:
            count = in_flight.get(h, 0)
            in_flight[h] = count + 1
            if not count:
                self._became_resident(h)

    def blocks_cached(self, req: Request, num_cached_blocks: int, hashes: list[BlockHash]) -> None:
        flight = self._flight_ranges.get(req.request_id)
        if flight is not None and flight[1] < num_cached_blocks:
            _, first, end = flight
            done = min(num_cached_blocks, end)
            self._untrack(req, first, done)
            if done < end:
                self._flight_ranges[req.request_id] = (req, done, end)
            else:
                del self._flight_ranges[req.request_id]
        for h in hashes:
            self._became_resident(h)

    def released(self, req: Request) -> None:
        flight = self._flight_ranges.pop(req.request_id, None)
        if flight is not None:
            self._untrack(req, flight[1], flight[2])

    def _untrack(self, req: Request, first: int, end: int) -> None:
        in_flight = self._in_flight
        for h in req.block_hashes[first:end]:
            left = in_flight[h] - 1
            if left:
                in_flight[h] = left
            else:
                del in_flight[h]

    def shares_in_flight(self, req: Request, num_hit_blocks: int) -> bool:
        """In-batch prefix sharing: pass ``req`` over for this step when its first block after
        its hits is one an admitted request is computing or loading now (next step it is a hit;
        admitted now, ``req`` would compute it a second time). Never a preempted request, nor
        one at its bound. One dict lookup."""
        if not self._caching or self._urgent or not isinstance(self._current, _Entry):
            return False
        hashes = req.block_hashes
        return num_hit_blocks < self._current.limit and hashes[num_hit_blocks] in self._in_flight


def _is_heap(items: Sequence[Any]) -> bool:
    """Whether ``items`` satisfies the min-heap property of :mod:`heapq`."""
    return all(not items[i] < items[(i - 1) // 2] for i in range(1, len(items)))
