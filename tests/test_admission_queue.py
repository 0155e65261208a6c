"""``CacheAwareQueue`` on its own: its rank (aging by admitted work, host-held blocks weighed by
what loading them saves), filings of aborted requests, and a stateful test that drives every
operation of the queue's protocol at random and checks its invariants after each one."""

from __future__ import annotations

import itertools
import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.engine.admission import CacheAwareQueue
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request
from kvoffload.engine.sampling import SamplingParams
from kvoffload.keys import BlockHasher

BLOCK = 4
HASHER = BlockHasher(BLOCK)


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), HASHER, 0.0)


class _Held:
    """A host tier whose holdings the test sets: the leading ``n`` blocks of every request, or
    of the requests in ``only`` when set; each held block is worth ``worth``."""

    def __init__(self) -> None:
        self.n = 0
        self.only: set[str] | None = None
        self.worth = 1.0

    def __call__(self, req: Request, first: int, end: int) -> int:
        if self.only is not None and req.request_id not in self.only:
            return 0
        return max(0, min(self.n, end) - first)

    def held_worth(self) -> float:
        return self.worth


def _blocks(request_id: str, n: int) -> Request:
    """A request of ``n`` full blocks (and one token more); distinct ids share no block."""
    return _request(request_id, [1 + zlib.crc32(request_id.encode()) % 250] * (BLOCK * n) + [255])


def _admit_next(queue: CacheAwareQueue) -> str:
    """One admission pass that admits the first candidate; returns its id."""
    queue.begin_pass()
    req = queue.next_candidate()
    assert req is not None
    queue.take(req)
    queue.admitted(req, 0)
    queue.end_pass()
    queue.check_invariants()
    return req.request_id


@pytest.mark.parametrize(("lead", "first"), [(4, "cold"), (6, "cold"), (7, "warm")])
def test_a_later_request_passes_an_older_one_only_by_a_lead_above_the_work_admitted_between(
    lead: int, first: str
) -> None:
    """``cold`` arrives with ``early``, and ``early`` is admitted (6 prompt blocks of work).
    Then ``warm`` arrives with ``lead`` blocks in the host tier: it goes before ``cold`` only if
    ``lead`` > 6 (``cold`` waited through more work than the lead saves). Before aging, any
    lead went first (a chat turn's round 1 passed by every warm later turn)."""
    held = _Held()
    held.n, held.only = lead, {"warm"}
    queue = CacheAwareQueue(BlockPool(64), BLOCK, max_bypass=32, held=held)
    queue.add(_blocks("early", 6))
    queue.add(_blocks("cold", 6))
    assert _admit_next(queue) == "early"
    queue.add(_blocks("warm", 8))
    assert _admit_next(queue) == first


def test_requests_that_arrive_together_go_longest_held_prefix_first() -> None:
    """No admission between their arrivals: pure longest-prefix order, whatever the lead."""
    held = _Held()
    held.n, held.only = 1, {"warm"}
    queue = CacheAwareQueue(BlockPool(64), BLOCK, max_bypass=32, held=held)
    queue.add(_blocks("early", 6))
    assert _admit_next(queue) == "early"
    queue.add(_blocks("cold", 6))
    queue.add(_blocks("warm", 8))
    assert [_admit_next(queue), _admit_next(queue)] == ["warm", "cold"]


def _queue_with_device_blocks(
    held: _Held, cached: Request, num_cached: int
) -> tuple[CacheAwareQueue, BlockPool]:
    """A queue whose device prefix cache holds ``cached``'s first ``num_cached`` blocks."""
    pool = BlockPool(64)
    queue = CacheAwareQueue(pool, BLOCK, max_bypass=32, held=held, held_worth=held.held_worth)
    blocks = pool.allocate(num_cached)
    assert blocks is not None
    pool.cache(blocks, cached.block_hashes, 0, num_cached)
    pool.free(blocks)
    return queue, pool


@pytest.mark.parametrize(("worth", "order"), [(1.0, ["held", "cold"]), (0.5, ["cold", "held"]), (0.0, ["cold", "held"])])
def test_held_blocks_count_by_what_loading_them_saves(worth: float, order: list[str]) -> None:
    """``cold`` waits; 3 prompt blocks are admitted; ``held`` arrives with 4 blocks in the host
    tier. Each held block worth 1 (loading is free): a lead of 4 > 3, ``held`` first. Worth 0.5
    (loading costs half of computing): 2 < 3, ``cold`` first. Worth 0 (``load_policy`` never, or
    loads that do not pay): the held run counts for nothing. Before, a held block counted 1
    whatever loading it cost."""
    held = _Held()
    held.n, held.only, held.worth = 4, {"held"}, worth
    queue = CacheAwareQueue(BlockPool(64), BLOCK, max_bypass=32, held=held, held_worth=held.held_worth)
    queue.add(_blocks("early", 3))
    queue.add(_blocks("cold", 5))
    assert _admit_next(queue) == "early"
    queue.add(_blocks("held", 5))
    assert [_admit_next(queue), _admit_next(queue)] == order


def test_device_resident_blocks_go_first_whatever_the_age() -> None:
    """``cold`` waits; 6 prompt blocks are admitted; then ``held`` (4 blocks in the host tier)
    and ``device`` (1 block in the device prefix cache) arrive. Device-resident blocks are
    volatile (the next admission may evict them) and free: ``device`` goes first, before the
    older ``cold``; ``held``'s lead (4 < 6) is not enough to pass ``cold``."""
    held = _Held()
    held.n, held.only = 4, {"held"}
    device = _blocks("device", 5)
    queue, _ = _queue_with_device_blocks(held, device, 1)
    queue.add(_blocks("early", 6))
    queue.add(_blocks("cold", 5))
    assert _admit_next(queue) == "early"
    queue.add(_blocks("held", 5))
    queue.add(device)
    assert [_admit_next(queue) for _ in range(3)] == ["device", "cold", "held"]


class CacheAwareQueueMachine(RuleBasedStateMachine):
    """Adds, aborts, preemptions, passes (admit / defer / stop), blocks entering the device cache
    and the host tier, admitted requests finishing: ``check_invariants`` holds after each."""

    def __init__(self) -> None:
        super().__init__()
        self.held = _Held()
        self.pool = BlockPool(64)
        self.queue = CacheAwareQueue(
            self.pool, BLOCK, max_bypass=3, held=self.held, held_worth=self.held.held_worth
        )
        self.ids = itertools.count()
        self.running: list[Request] = []

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 5), tail=st.integers(0, 2))
    def add(self, prefix: int, length: int, tail: int) -> None:
        tokens = [prefix] * (BLOCK * length) + [100 + tail] * (1 + tail)
        self.queue.add(_request(f"r{next(self.ids)}", tokens))

    @precondition(lambda self: len(self.queue) > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        waiting = list(self.queue)
        self.queue.remove(data.draw(st.sampled_from(waiting)))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        self.queue.released(req)
        self.queue.add_preempted(req)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        """A running request's prompt blocks enter the device cache (up to ``n``)."""
        req = data.draw(st.sampled_from(self.running))
        n = data.draw(st.integers(0, len(req.block_hashes)))
        self.queue.blocks_cached(req, n, req.block_hashes[:n])

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        self.queue.released(req)

    @rule(n=st.integers(0, 3), worth=st.sampled_from([0.0, 0.5, 1.0]))
    def host_tier_changes(self, n: int, worth: float) -> None:
        """The host tier holds other blocks; what loading one saves changes (read next pass)."""
        self.held.n = n
        self.held.worth = worth

    @rule(actions=st.lists(st.sampled_from(["take", "defer", "stop"]), max_size=6))
    def admission_pass(self, actions: list[str]) -> None:
        queue = self.queue
        queue.begin_pass()
        for action in actions:
            req = queue.next_candidate()
            if req is None or action == "stop":
                break
            if action == "take":
                queue.take(req)
                queue.admitted(req, 0)
                self.running.append(req)
            else:
                queue.defer(req)
        queue.end_pass()

    @invariant()
    def consistent(self) -> None:
        self.queue.check_invariants()


CacheAwareQueueMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_aware_queue_stateful = CacheAwareQueueMachine.TestCase
