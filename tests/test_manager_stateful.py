"""The manager contract under random call sequences, for every registered eviction policy.

A hypothesis state machine drives a small CPUOffloadingManager (bare, and wrapped in
FilterReusedOffloadingManager) from several concurrent requests and checks it against a simple
reference model of what docs/manager-contract.md promises: which blocks are held and in which
state, how many readers pin each, what prepare_store may store and evict, and that the event
stream, replayed, always equals the set of readable blocks. The bare manager also runs against a
twin that never sees the prepare_store calls answered ``None``: any later difference would mean a
rejected call changed state.
"""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload import (
    ContractError,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    available_eviction_policies,
    make_offload_key,
)
from kvoffload.eviction import EvictionPolicy

CAPACITY = 4
UNIVERSE = [make_offload_key(i.to_bytes(8, "big"), i % 2) for i in range(8)]
NUM_REQUESTS = 3
STORE_THRESHOLD = 2
TRACKER_SIZE = 6  # below the universe, so that tracked keys get dropped
# Counters that record an attempt rather than a state: a rejected prepare_store may move them.
ATTEMPT_COUNTERS = {"rejected_stores", "not_admitted_blocks", "filtered_blocks", "tracked_keys"}
#: Policies that decide as vLLM 0.33's own (tests/test_vllm_parity.py).
VLLM_POLICIES = {"lru", "arc"}

MISS, HIT, HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING

key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=5)
requests = st.integers(0, NUM_REQUESTS - 1)


@dataclass
class Request:
    """One request of the model: its context and the transfers it still has to complete."""

    ctx: ReqContext
    pending: list[OffloadKey] = field(default_factory=list)  # keys it prepared, store not completed
    pins: list[OffloadKey] = field(default_factory=list)  # one entry per prepare_load pin it holds
    seen: set[OffloadKey] = field(default_factory=set)  # keys the reuse filter counted it for

    @property
    def idle(self) -> bool:
        return not self.pending and not self.pins


def dedupe(keys: list[OffloadKey]) -> list[OffloadKey]:
    return list(dict.fromkeys(keys))


def is_subsequence(short: list[OffloadKey], long: list[OffloadKey]) -> bool:
    it = iter(long)
    return all(key in it for key in short)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self, policy: str, wrapped: bool) -> None:
        super().__init__()
        self.cpu = CPUOffloadingManager(CAPACITY, policy, enable_events=True)
        self.manager: OffloadingManager = (
            FilterReusedOffloadingManager(self.cpu, STORE_THRESHOLD, TRACKER_SIZE)
            if wrapped
            else self.cpu
        )
        self.wrapped = wrapped
        self.policy_admits = type(self.cpu.policy).admit is not EvictionPolicy.admit
        # The twin misses the rejected calls, so it needs a manager whose rejected calls leave no
        # trace at all: not the filter (it counts the offer), nor a policy that learns from admit(),
        # nor lru and arc: as vLLM's, they count a rejected offer as the request's access (and ARC
        # adapts to its ghost keys) before the eviction fails.
        self.twin = (
            None
            if wrapped or self.policy_admits or policy in VLLM_POLICIES
            else CPUOffloadingManager(CAPACITY, policy, enable_events=True)
        )
        self.probe = ReqContext("probe")  # for invariant lookups, straight to the CPU manager
        self.requests = [Request(ReqContext(f"req-{i}")) for i in range(NUM_REQUESTS)]
        self.next_request_id = NUM_REQUESTS
        # The model.
        self.pending: dict[OffloadKey, Request] = {}
        self.ready: Counter[OffloadKey] = Counter()  # readable key -> readers pinning it (0 kept)
        self.announced: set[OffloadKey] = set()  # what the drained events said is readable
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()  # wrapped only: the reuse tracker

    # ------------------------------------------------------------------ helpers

    def snapshot(self) -> tuple[list[tuple[OffloadKey, int, int]], dict[str, int]]:
        """Blocks (in the policy's order) and state gauges: what must not move on a rejected call."""
        blocks = [(key, block.slot, block.ref_cnt) for key, block in self.cpu.items()]
        stats = {
            name: value
            for name, value in self.manager.stats().items()
            if name not in ATTEMPT_COUNTERS
        }
        return blocks, stats

    def absent(self, key: OffloadKey) -> bool:
        return key not in self.pending and key not in self.ready

    def see(self, keys: list[OffloadKey], req: Request) -> None:
        """The reuse filter's count: distinct requests per key, in an LRU table of TRACKER_SIZE keys."""
        if not self.wrapped:
            return
        for key in keys:
            if key in req.seen:
                continue
            req.seen.add(key)
            if key in self.counts:
                self.counts[key] += 1
                self.counts.move_to_end(key)
            else:
                if len(self.counts) >= TRACKER_SIZE:
                    self.counts.popitem(last=False)
                self.counts[key] = 1

    def slots(self) -> dict[OffloadKey, int]:
        return {key: block.slot for key, block in self.cpu.items()}

    def replay_events(self) -> None:
        events = self.manager.take_events()
        if self.twin is not None:
            assert self.twin.take_events() == events
        for event in events:
            assert event.medium == "CPU"
            for key in event.keys:
                if event.removed:
                    assert key in self.announced, "removal of a block never announced"
                    self.announced.remove(key)
                else:
                    assert key not in self.announced, "a block announced twice"
                    self.announced.add(key)
        assert self.announced == set(self.ready)
        assert self.manager.take_events() == []

    # ------------------------------------------------------------------ rules

    @initialize(keys=st.lists(st.sampled_from(UNIVERSE), max_size=CAPACITY, unique=True))
    def warm_up(self, keys: list[OffloadKey]) -> None:
        """Blocks stored before the requests start, straight into the tier (past any filter, so the
        filter has not counted them: it must still pass them through when a request offers them)."""
        ctx = ReqContext("warm-up")
        out = self.cpu.prepare_store(keys, ctx)
        assert out is not None and out.evicted_keys == []
        self.cpu.complete_store(out.keys_to_store, ctx)
        if self.twin is not None:
            assert self.twin.prepare_store(keys, ctx) == out
            self.twin.complete_store(out.keys_to_store, ctx)
        self.ready.update(dict.fromkeys(out.keys_to_store, 0))

    @rule(r=requests, key=st.sampled_from(UNIVERSE))
    def lookup(self, r: int, key: OffloadKey) -> None:
        req = self.requests[r]
        result = self.manager.lookup(key, req.ctx)
        self.see([key], req)
        if self.twin is not None:
            assert self.twin.lookup(key, req.ctx) is result
        expected = HIT_PENDING if key in self.pending else HIT if key in self.ready else MISS
        assert result is expected

    @rule(r=requests, keys=key_lists, complete_now=st.booleans())
    def prepare_store(self, r: int, keys: list[OffloadKey], complete_now: bool) -> None:
        """Offer ``keys``; with ``complete_now`` the transfer also finishes at once (a short step)."""
        req = self.requests[r]
        before = self.snapshot()
        free = CAPACITY - len(before[0])
        self.see(keys, req)
        candidates = [
            key
            for key in dedupe(keys)
            if self.absent(key) and (not self.wrapped or self.counts.get(key, 0) >= STORE_THRESHOLD)
        ]
        evictable = {key for key, pins in self.ready.items() if pins == 0 and key not in keys}

        out = self.manager.prepare_store(keys, req.ctx)
        if out is None:
            assert self.snapshot() == before, "a rejected prepare_store changed state"
            if not self.policy_admits:
                assert len(candidates) - free > len(evictable), "rejected although there was room"
            return
        if self.twin is not None:
            assert self.twin.prepare_store(keys, req.ctx) == out

        stored, evicted = out.keys_to_store, out.evicted_keys
        if self.policy_admits:
            assert is_subsequence(stored, candidates)
        else:
            assert stored == candidates
        assert len(evicted) == max(0, len(stored) - free), "evicted more (or less) than needed"
        assert len(set(evicted)) == len(evicted)
        assert set(evicted) <= evictable, "evicted a pinned, pending or protected block"
        block_ids = out.store_spec.block_ids  # type: ignore[attr-defined]
        assert len(block_ids) == len(stored)

        for key in evicted:
            del self.ready[key]
        for key in stored:
            self.pending[key] = req
            req.pending.append(key)
        slots = self.slots()
        assert [slots[key] for key in stored] == block_ids
        if complete_now and stored:
            self.complete(req, stored, stored, success=True)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        req = data.draw(st.sampled_from([req for req in self.requests if req.pending]))
        done = data.draw(st.lists(st.sampled_from(req.pending), min_size=1, unique=True))
        # Keys that are not pending anywhere are ignored, whatever their state.
        ignored = (
            data.draw(st.lists(st.sampled_from(sorted(self.ready)), max_size=2))
            if self.ready
            else []
        )
        ignored += data.draw(
            st.lists(st.sampled_from([k for k in UNIVERSE if self.absent(k)]), max_size=1)
        )
        self.complete(req, done, data.draw(st.permutations(done + ignored)), success)

    def complete(
        self, req: Request, done: list[OffloadKey], listed: list[OffloadKey], success: bool
    ) -> None:
        """Complete the stores of ``done`` (pending for ``req``) with one call listing ``listed``."""
        for manager in (self.manager, self.twin):
            if manager is not None:
                manager.complete_store(listed, req.ctx, success=success)
        for key in done:
            del self.pending[key]
            req.pending.remove(key)
            if success:
                self.ready[key] = 0

    @rule(r=requests, data=st.data(), misuse=st.integers(0, 3))
    def prepare_load(self, r: int, data: st.DataObject, misuse: int) -> None:
        """Pin some readable keys (duplicates too); one call in four is a misuse instead."""
        req = self.requests[r]
        readable = sorted(self.ready)
        if misuse == 0 or not readable:
            self.prepare_load_of_a_non_hit_key(req, data, readable)
            return
        keys = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=4))
        spec = self.manager.prepare_load(keys, req.ctx)
        if self.twin is not None:
            assert self.twin.prepare_load(keys, req.ctx) == spec
        slots = self.slots()
        assert spec.block_ids == [slots[key] for key in keys]  # type: ignore[attr-defined]
        self.ready.update(keys)
        req.pins.extend(keys)

    def prepare_load_of_a_non_hit_key(
        self, req: Request, data: st.DataObject, readable: list[OffloadKey]
    ) -> None:
        """A MISS or HIT_PENDING key anywhere in the list: ContractError, nothing pinned."""
        keys = data.draw(st.lists(st.sampled_from(readable), max_size=3)) if readable else []
        culprits = [
            group
            for group in (sorted(self.pending), [k for k in UNIVERSE if self.absent(k)])
            if group
        ]
        bad = data.draw(st.sampled_from(data.draw(st.sampled_from(culprits))))
        keys.insert(data.draw(st.integers(0, len(keys))), bad)
        before = self.snapshot()
        for manager in (self.manager, self.twin):
            if manager is not None:
                with pytest.raises(ContractError):
                    manager.prepare_load(keys, req.ctx)
        assert self.snapshot() == before

    @rule(data=st.data(), misuse=st.integers(0, 3))
    def complete_load(self, data: st.DataObject, misuse: int) -> None:
        """Release some pins of a request holding some; one call in four is a misuse instead."""
        req = data.draw(
            st.sampled_from([req for req in self.requests if req.pins] or self.requests)
        )
        if misuse == 0 or not req.pins:
            self.complete_load_of_an_unpinned_key(req, data)
            return
        positions = data.draw(st.lists(st.integers(0, len(req.pins) - 1), min_size=1, unique=True))
        keys = [req.pins[i] for i in positions]
        self.manager.complete_load(keys, req.ctx)
        if self.twin is not None:
            self.twin.complete_load(keys, req.ctx)
        for i in sorted(positions, reverse=True):
            del req.pins[i]
        self.ready.subtract(keys)

    def complete_load_of_an_unpinned_key(self, req: Request, data: st.DataObject) -> None:
        """An unpinned key anywhere in the list (ready but unread, pending, absent, or released once
        more than it is pinned): ContractError, no pin released."""
        keys = (
            data.draw(st.lists(st.sampled_from(req.pins), max_size=2, unique=True))
            if req.pins
            else []
        )
        unread = [key for key, readers in self.ready.items() if readers == 0]
        absent = [key for key in UNIVERSE if self.absent(key)]
        culprits = [group for group in (unread, sorted(self.pending), absent, req.pins) if group]
        bad = data.draw(st.sampled_from(data.draw(st.sampled_from(culprits))))
        extra = self.ready[bad] + 1 - keys.count(bad) if bad in req.pins else 1
        keys = data.draw(st.permutations(keys + [bad] * extra))
        before = self.snapshot()
        for manager in (self.manager, self.twin):
            if manager is not None:
                with pytest.raises(ContractError):
                    manager.complete_load(keys, req.ctx)
        assert self.snapshot() == before

    @rule(r=requests, keys=key_lists)
    def touch(self, r: int, keys: list[OffloadKey]) -> None:
        req = self.requests[r]
        for manager in (self.manager, self.twin):
            if manager is not None:
                manager.touch(keys, req.ctx)

    @rule()
    def take_events(self) -> None:
        self.replay_events()

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        if now:  # one draw in four: a reset wipes what the other rules built up
            return
        for manager in (self.manager, self.twin):
            if manager is not None:
                manager.reset()
        # Completions of transfers started before the reset are discarded by the caller.
        self.pending.clear()
        self.ready.clear()
        for req in self.requests:
            req.pending.clear()
            req.pins.clear()

    @precondition(lambda self: any(req.idle for req in self.requests))
    @rule(data=st.data())
    def request_finished(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, req in enumerate(self.requests) if req.idle]))
        for manager in (self.manager, self.twin):
            if manager is not None:
                manager.request_finished(self.requests[i].ctx)
        self.requests[i] = Request(ReqContext(f"req-{self.next_request_id}"))
        self.next_request_id += 1

    # ------------------------------------------------------------------ invariants

    @invariant()
    def manager_matches_model(self) -> None:
        self.cpu.check_invariants()
        if self.twin is not None:
            self.twin.check_invariants()
        blocks = dict(self.cpu.items())
        assert len(blocks) <= CAPACITY
        assert self.cpu.stats()["used_blocks"] == len(blocks)
        assert blocks.keys() == self.pending.keys() | self.ready.keys()
        for key in self.pending:
            assert blocks[key].ref_cnt == -1
            assert self.cpu.lookup(key, self.probe) is HIT_PENDING
        for key, readers in self.ready.items():
            assert blocks[key].ref_cnt == readers
            assert self.cpu.lookup(key, self.probe) is HIT

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a rule failed: the model is out of step, and one report is enough
        # Every request completes its loads and stores: then nothing is pinned or pending.
        for req in self.requests:
            for manager in (self.manager, self.twin):
                if manager is not None:
                    manager.complete_load(req.pins, req.ctx)
                    manager.complete_store(req.pending, req.ctx)
            self.ready.subtract(req.pins)
            for key in req.pending:
                del self.pending[key]
                self.ready[key] = 0
        self.manager_matches_model()
        assert all(block.ref_cnt == 0 for _, block in self.cpu.items())
        self.replay_events()


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "filter-reused"])
@pytest.mark.parametrize("policy", available_eviction_policies())
def test_manager_contract_holds_under_random_calls(policy: str, wrapped: bool) -> None:
    run_state_machine_as_test(lambda: ManagerMachine(policy, wrapped), settings=SETTINGS)  # type: ignore[arg-type]
