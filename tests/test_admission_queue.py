"""``CacheAwareQueue`` on its own: filings of aborted requests, and a stateful test that drives
every operation of the queue's protocol at random and checks its invariants after each one."""

from __future__ import annotations

import itertools

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
    """A host tier whose holdings the test sets: the leading ``n`` blocks of every request."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, req: Request, first: int, end: int) -> int:
        return max(0, min(self.n, end) - first)


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
        self.queue = CacheAwareQueue(self.pool, BLOCK, max_bypass=3, held=self.held)
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

    @rule(n=st.integers(0, 3))
    def host_tier_changes(self, n: int) -> None:
        self.held.n = n

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
