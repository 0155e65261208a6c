"""The secondary-tier contract for :class:`RedisTier` under random call sequences on a real
server: stores, loads, lookups, values damaged or deleted behind the tier's back, completions.

Checked: every job is reported exactly once; a key answers ``HIT`` only after a store of it was
reported (or the server was asked); a key asked before ``wait_for_answers`` is answered after it; a load's successful keys hold exactly their block's bytes,
its failed keys have a known cause and, unless the payload's checksum failed (the header is
checked before the payload is received, the checksum after), leave their slot untouched (so a
damaged or deleted value never loads).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis_servers import RedisServer
from remote_cases import WAIT_S, make_layout, make_tier

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers.contract import TierJob
from kvoffload.tiers.redis.tier import remote_key_prefix

BLOCK = 256
SLOTS = 16
UNIVERSE = [make_offload_key(i.to_bytes(32, "big")) for i in range(8)]
CAUSES = {"missing", "checksum", "layout", "corrupt", "io", "timeout", "full"}
SLOT_MARK = b"\xee" * BLOCK  # what a load target slot holds before the load


def content(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def run_machine(server: RedisServer) -> None:
    class RedisTierMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.buffer = bytearray(SLOTS * BLOCK)
            self.pool = memoryview(self.buffer).cast("B", (SLOTS, BLOCK))
            self.layout = make_layout(block_bytes=BLOCK)
            self.tier = make_tier(server.url, self.pool, self.layout, answer_wait_s=WAIT_S)
            self.prefix = remote_key_prefix(self.layout)
            self.ctx = ReqContext("machine")
            self.next_job = 0
            self.jobs: dict[int, tuple[bool, list[OffloadKey], list[int]]] = {}
            self.reported: set[int] = set()
            self.stored: set[bytes] = set()  # reported stored at least once
            self.busy_slots: set[int] = set()

        def _free_slots(self, n: int) -> list[int] | None:
            free = [s for s in range(SLOTS) if s not in self.busy_slots][:n]
            return free if len(free) == n else None

        @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True))
        def store(self, keys: list[OffloadKey]) -> None:
            slots = self._free_slots(len(keys))
            if slots is None:
                return
            for key, slot in zip(keys, slots, strict=True):
                self.pool.cast("B")[slot * BLOCK : (slot + 1) * BLOCK] = content(key)
            self._submit(True, keys, slots)

        @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True))
        def load(self, keys: list[OffloadKey]) -> None:
            keys = [k for k in keys if self.tier.lookup(k, self.ctx) is LookupResult.HIT]
            slots = self._free_slots(len(keys))
            if not keys or slots is None:
                return
            for slot in slots:
                self.pool.cast("B")[slot * BLOCK : (slot + 1) * BLOCK] = SLOT_MARK
            self._submit(False, keys, slots)

        def _submit(self, is_store: bool, keys: list[OffloadKey], slots: list[int]) -> None:
            self.next_job += 1
            job = TierJob(self.next_job, list(keys), list(slots))
            self.jobs[job.job_id] = (is_store, list(keys), list(slots))
            self.busy_slots.update(slots)
            (self.tier.submit_store if is_store else self.tier.submit_load)(job)

        @precondition(lambda self: self.stored)
        @rule(data=st.data(), how=st.sampled_from(["garbage", "cut", "flip", "delete"]))
        def damage(self, data: st.DataObject, how: str) -> None:
            key = data.draw(st.sampled_from(sorted(self.stored)))
            self.tier.drain_jobs()  # a store in flight would repair it
            with server.client() as c:
                rkey = self.prefix + key
                value = c.get(rkey)
                if value is None:
                    return
                if how == "garbage":
                    c.set(rkey, b"\0" * len(value))
                elif how == "cut":
                    c.set(rkey, value[:-1])
                elif how == "flip":
                    c.set(rkey, value[:-1] + bytes([value[-1] ^ 1]))
                else:
                    c.delete(rkey)

        @rule()
        def finish(self) -> None:
            self.tier.drain_jobs()
            for result in self.tier.get_finished_jobs():
                assert result.job_id in self.jobs and result.job_id not in self.reported
                self.reported.add(result.job_id)
                is_store, keys, slots = self.jobs.pop(result.job_id)
                assert result.is_store == is_store
                assert set(result.failed_keys) <= set(keys)
                assert set(result.failed_keys.values()) <= CAUSES
                self.busy_slots.difference_update(slots)
                for key, slot in zip(keys, slots, strict=True):
                    got = bytes(self.pool.cast("B")[slot * BLOCK : (slot + 1) * BLOCK])
                    if is_store:
                        if key not in result.failed_keys:
                            self.stored.add(key)
                    elif key in result.failed_keys:
                        if result.failed_keys[key] != "checksum":  # found from the header
                            assert got == SLOT_MARK  # a failed load leaves its slot alone
                    else:  # damaged values never load: only a block's own bytes do
                        assert got == content(key)

        @rule()
        def wait_for_answers(self) -> None:
            """Every key unanswered before :meth:`RedisTier.wait_for_answers` (its bound far
            beyond the server's answer here) is answered after it: no ``RETRY``."""
            before = {key: self.tier.lookup(key, self.ctx) for key in UNIVERSE}
            self.tier.wait_for_answers()
            for key, answer in before.items():
                if answer is LookupResult.RETRY:
                    assert self.tier.lookup(key, self.ctx) is not LookupResult.RETRY

        @invariant()
        def hits_were_stored(self) -> None:
            storing = {k for is_store, keys, _ in self.jobs.values() if is_store for k in keys}
            for key in UNIVERSE:
                if self.tier.lookup(key, self.ctx) is LookupResult.HIT:
                    assert key in self.stored | storing

        def teardown(self) -> None:
            self.tier.close()
            self.finish()
            assert not self.jobs

    run_state_machine_as_test(
        RedisTierMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_redis_tier_contract(redis_server: RedisServer) -> None:
    run_machine(redis_server)
