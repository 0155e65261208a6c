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


def test_held_blocks_count_by_what_loading_them_saves() -> None:
    """Two requests arrive together: ``device`` with 3 blocks in the device cache, ``held`` with
    4 in the host tier. Each held block worth 1: ``held`` first (4 > 3). Worth 0.5 (loading costs
    half of computing): ``device`` first (2 < 3). Worth 0 (``load_policy`` never, or loads that
    do not pay): a held run counts for nothing, arrival order among cold requests."""
    order = {}
    for worth in (1.0, 0.5, 0.0):
        held = _Held()
        held.n, held.only, held.worth = 4, {"held"}, worth
        pool = BlockPool(64)
        queue = CacheAwareQueue(pool, BLOCK, max_bypass=32, held=held, held_worth=held.held_worth)
        cached = _blocks("device", 5)
        blocks = pool.allocate(3)
        assert blocks is not None
        pool.cache(blocks, cached.block_hashes, 0, 3)
        pool.free(blocks)
        queue.add(_blocks("cold", 5))
        queue.add(_blocks("held", 5))
        queue.add(cached)
        order[worth] = [_admit_next(queue) for _ in range(3)]
    assert order == {
        1.0: ["held", "device", "cold"],
        0.5: ["device", "held", "cold"],
        0.0: ["device", "cold", "held"],
    }


def test_aborted_requests_leave_no_filing_after_their_score_fell() -> None:
    """Scores fall (the host tier dropped blocks), a pass re-files every request under a new
    frontier, then every request is aborted: nothing of them stays in the queue."""
    held = _Held()
    held.n = 2
    queue = CacheAwareQueue(BlockPool(64), BLOCK, max_bypass=1000, held=held)
    requests = [_request(f"r{i}", [i] * 8 + [i, 1, 2, 3, 4]) for i in range(1000)]
    for req in requests:
        queue.add(req)
    held.n = 0
    queue.begin_pass()
    first = queue.next_candidate()
    assert first is not None
    queue.defer(first)
    queue.end_pass()
    queue.check_invariants()
    for req in requests:
        queue.remove(req)
    assert len(queue) == 0
    queue.check_invariants()
    assert not queue._frontier, f"{len(queue._frontier)} filings left behind"


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
