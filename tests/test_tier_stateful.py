"""The secondary-tier contract (docs/tiers.md) and the tiering manager under random call sequences.

``DiskTierMachine`` drives a small disk tier on real files: stores, loads, outside damage (a
flipped byte, a file another process deleted) and completions; it checks the five invariants of
``kvoffload/tiers/contract.py``. ``TieringMachine`` drives a host tier + disk tier through the
:class:`OffloadingManager` contract as the connector and worker would (lookups that may answer
``RETRY``, device stores written into host slots, device loads read from them, one step hook per
step) and checks that every readable host block holds exactly its own bytes: promotions write
the right bytes, cascades never read a slot that was reused, nothing pinned is evicted.

Whether a random run reaches the rare paths (a refused promotion, a wait for host room, a block
lost before its cascade) depends on the seed, so fixed scripts play each of them through the same
rules and invariant (``test_tiering_manager_paths*``), whatever the seed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tier_cases import (
    BLOCK_BYTES,
    dir_bytes_at_once,
    host_pool,
    key,
    layout,
    slot_bytes,
)

from kvoffload.keys import OffloadKey
from kvoffload.load_store_specs import CPULoadStoreSpec
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.ledger import MEASURE
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import LEDGER_BYTES, DiskTier

MISS, HIT, HIT_PENDING, RETRY = (
    LookupResult.MISS,
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
UNIVERSE = [key(i) for i in range(10)]
POOL_SLOTS = 24
DISK_BLOCKS = 5
FILE = file_bytes(BLOCK_BYTES)
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def small_disk_tier(
    path: Path, pool: memoryview, enable_events: bool = False, compression: str = "none"
) -> DiskTier:
    """A disk tier of ``DISK_BLOCKS`` raw blocks' bytes on real files, without the rescan
    thread (``compression``: its codec; compressed, more blocks fit)."""
    settings = DiskTierSettings(
        path, LEDGER_BYTES + DISK_BLOCKS * FILE, rescan_interval=0, compression=compression
    )
    return DiskTier(pool, layout(), settings, enable_events=enable_events)


def content(k: bytes) -> bytes:
    """The one right payload of block ``k`` (so stale or mixed bytes are always noticed)."""
    return (k * (BLOCK_BYTES // len(k) + 1))[:BLOCK_BYTES]


def write_slot(pool: memoryview, slot: int, data: bytes) -> None:
    pool.cast("B")[slot * BLOCK_BYTES : (slot + 1) * BLOCK_BYTES] = data


class DiskTierMachine(RuleBasedStateMachine):
    #: The tier's codec (``CompressedDiskTierMachine`` in ``test_disk_compression.py``).
    compression = "none"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvo-tier-"))
        self.pool = host_pool(POOL_SLOTS)
        self.tier = small_disk_tier(self.dir, self.pool, compression=self.compression)
        self.ctx = ReqContext("machine")
        self.next_job = 0
        self.free_slots = list(range(POOL_SLOTS))
        self.jobs: dict[int, tuple[bool, list[OffloadKey], list[int]]] = {}  # unreported
        self.reported: set[int] = set()
        self.pending: Counter[OffloadKey] = Counter()  # keys a store of ours is writing
        self.stored: set[OffloadKey] = set()  # reported stored at least once (may be evicted since)
        self.pins: Counter[OffloadKey] = Counter()  # keys read by unreported loads
        self.damaged: set[OffloadKey] = set()
        self.writes: dict[int, list[OffloadKey]] = {}  # store job -> keys it writes (absent at submit)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _job(self, is_store: bool, keys: list[OffloadKey]) -> TierJob | None:
        if len(keys) > len(self.free_slots):
            return None
        slots = [self.free_slots.pop() for _ in keys]
        self.next_job += 1
        self.jobs[self.next_job] = (is_store, keys, slots)
        return TierJob(self.next_job, keys, slots)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4))
    def store(self, keys: list[OffloadKey]) -> None:
        new = [k for k in dict.fromkeys(keys) if self.tier.lookup(k, self.ctx) is MISS]
        job = self._job(True, keys)
        if job is None:
            return
        for k, slot in zip(keys, job.slots, strict=True):
            write_slot(self.pool, slot, content(k))
        self.tier.submit_store(job, self.ctx)
        self.writes[job.job_id] = new
        for k in new:
            self.pending[k] += 1
            # A key being written is never readable before its write completed (invariant 1).
            assert self.tier.lookup(k, self.ctx) in (HIT_PENDING, MISS)

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        readable = [k for k in UNIVERSE if self.tier.lookup(k, self.ctx) is HIT]
        if not readable:
            return
        keys = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3))
        job = self._job(False, keys)
        if job is None:
            return
        for slot in job.slots:
            write_slot(self.pool, slot, bytes(BLOCK_BYTES))
        self.tier.submit_load(job, self.ctx)
        self.pins.update(keys)

    @rule(k=st.sampled_from(UNIVERSE), how=st.sampled_from(["flip", "delete"]))
    def damage(self, k: OffloadKey, how: str) -> None:
        """Another process (or the disk) changes a file behind the tier's back."""
        if self.tier.lookup(k, self.ctx) is not HIT or self.pins[k] or k in self.damaged:
            return
        path = Path(self.tier._files.path_of(k))
        if how == "delete":  # a compressed tier's files are counted by their measured size
            self.tier._ledger.remove(str(path), MEASURE if self.tier.sized else FILE)
        else:
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 1
            path.write_bytes(bytes(raw))
        self.damaged.add(k)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), max_size=4))
    def touch(self, keys: list[OffloadKey]) -> None:
        self.tier.touch(keys, self.ctx)

    @rule()
    def finish(self) -> None:
        # Always after draining: what the machine draws next must not depend on thread timing.
        self.tier.drain_jobs()
        for result in self.tier.get_finished_jobs():
            # Every job is reported exactly once (invariant 5).
            assert result.job_id in self.jobs and result.job_id not in self.reported
            self.reported.add(result.job_id)
            is_store, keys, slots = self.jobs.pop(result.job_id)
            assert result.is_store == is_store
            assert set(result.failed_keys) <= set(keys)
            if is_store:
                written = self.writes.pop(result.job_id)
                for k in written:
                    self.pending[k] -= 1
                    if k not in result.failed_keys:
                        self.stored.add(k)
                        self.damaged.discard(k)  # a fresh file (held keys are skipped)
            else:
                for k, slot in zip(keys, slots, strict=True):
                    self.pins[k] -= 1
                    if k in result.failed_keys:
                        cause = result.failed_keys[k]
                        assert k in self.damaged, f"load of an intact block failed: {cause}"
                        assert cause in ("missing", "checksum")
                    else:
                        # A load returns exactly the stored bytes (invariant 2).
                        assert slot_bytes(self.pool, slot) == content(k)
                for k in result.failed_keys:
                    if not self.pins[k]:
                        assert self.tier.lookup(k, self.ctx) is MISS  # dropped
                        self.damaged.discard(k)
            self.free_slots.extend(slots)  # the tier no longer touches them (invariant 3)
        self.tier.check_ledger()  # the shared count equals the files, whatever happened

    @invariant()
    def pinned_blocks_stay(self) -> None:
        # Never evicted while a load reads it (invariant 4).
        for k, n in self.pins.items():
            if n:
                assert self.tier.lookup(k, self.ctx) is HIT

    @invariant()
    def bounded(self) -> None:
        stats = self.tier.stats()
        assert stats["used_blocks"] <= self.tier.capacity_blocks  # DISK_BLOCKS when raw
        # At one instant (stores may be in flight): see ``dir_bytes_at_once``.
        assert dir_bytes_at_once(self.tier, self.dir) <= self.tier.capacity_bytes


def test_disk_tier_contract() -> None:
    run_state_machine_as_test(DiskTierMachine, settings=SETTINGS)


HOST_BLOCKS = 4


def _request(name: str) -> ReqContext:
    """Requests 0 to 2 may cascade to every tier; request 3 to none (``kv_store_tiers: []``)."""
    return ReqContext(name, {"kv_store_tiers": []} if name.startswith("req-3") else {})


class TieringMachine(RuleBasedStateMachine):
    """The connector's and the worker's part, played by the machine."""

    CASCADE = "write_through"
    EVICT_HEADROOM = 0.125  # on_evict: cascade once fewer than this share of slots is free
    MAX_IN_FLIGHT = HOST_BLOCKS  # cascade writes in flight: never reached by these scripts
    MIN_REUSE = 1  # every block is worth a write

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvo-tiering-"))
        self.pool = host_pool(HOST_BLOCKS)
        self.host = CPUOffloadingManager(HOST_BLOCKS, "lru", enable_events=True)
        self.disk = small_disk_tier(self.dir, self.pool, enable_events=True)
        self.manager = TieringOffloadingManager(
            self.host,
            [self.disk],
            self.CASCADE,
            self.EVICT_HEADROOM,
            max_in_flight=self.MAX_IN_FLIGHT,
            min_reuse=self.MIN_REUSE,
        )
        #: key -> the requests that looked it up or offered it (the manager's reuse signal)
        self.seen: dict[OffloadKey, set[str]] = {}
        self.ctxs = [_request(f"req-{i}") for i in range(4)]
        self.device_pins: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.stores: list[tuple[ReqContext, list[OffloadKey]]] = []  # prepared device stores
        self.in_host: set[OffloadKey] = set()  # replayed from host events
        self.on_disk: set[OffloadKey] = set()  # replayed from disk events
        self.may_cascade: set[OffloadKey] = set()  # written into the host by a request allowing disk

    def teardown(self) -> None:
        try:
            self._end_everything()
        finally:
            self.manager.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _end_everything(self) -> None:
        """Every transfer completes and every request ends: no host pin of any kind is left
        (loads, cascades, promotions pinned for their request)."""
        for ctx, keys in self.device_pins:
            self.manager.complete_load(keys, ctx)
        for ctx, keys in self.stores:
            self.manager.complete_store(keys, ctx)
        self.device_pins, self.stores = [], []
        for ctx in self.ctxs:
            self.manager.request_finished(ctx)
        self.manager.drain()
        self.manager.check_invariants()
        assert self.manager.stats()["pinned_promoted_blocks"] == 0
        held = {k.hex(): b.ref_cnt for k, b in self.host.items() if b.ref_cnt != 0}
        assert not held, f"host blocks left pinned or pending: {held}"

    @rule(r=st.integers(0, 3), keys=st.lists(st.sampled_from(UNIVERSE[:7]), min_size=1, max_size=4))
    def lookup_chain(self, r: int, keys: list[OffloadKey]) -> None:
        """The connector's scan: on past RETRY answers, stop at MISS / HIT_PENDING."""
        ctx = self.ctxs[r]
        for k in keys:
            answer = self._lookup(k, ctx)
            if answer is HIT:
                assert self.host.lookup(k, ctx) is HIT
            if answer in (MISS, HIT_PENDING):
                break

    @rule(
        r=st.integers(0, 3),
        keys=st.lists(st.sampled_from(UNIVERSE[:7]), min_size=1, max_size=3),
        now=st.sampled_from([True, True, False]),
    )
    def device_store(self, r: int, keys: list[OffloadKey], now: bool) -> None:
        """Prepare a device -> host store; complete it at once (``now``) or in a later rule."""
        ctx = self.ctxs[r]
        for k in keys:
            self.seen.setdefault(k, set()).add(ctx.req_id)
        out = self.manager.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            return
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        for k, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            write_slot(self.pool, slot, content(k))  # the worker's device -> host copy
        if now:
            self.manager.complete_store(out.keys_to_store, ctx)
            self._stored(ctx, out.keys_to_store)
        else:
            self.stores.append((ctx, out.keys_to_store))

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 10), ok=st.booleans())
    def complete_device_store(self, i: int, ok: bool) -> None:
        ctx, keys = self.stores.pop(i % len(self.stores))
        self.manager.complete_store(keys, ctx, success=ok)
        if ok:
            self._stored(ctx, keys)

    def _lookup(self, k: OffloadKey, ctx: ReqContext) -> LookupResult:
        self.seen.setdefault(k, set()).add(ctx.req_id)
        return self.manager.lookup(k, ctx)

    def _stored(self, ctx: ReqContext, keys: list[OffloadKey]) -> None:
        if ctx.kv_transfer_params.get("kv_store_tiers") != []:
            self.may_cascade.update(keys)

    @rule(r=st.integers(0, 3), data=st.data())
    def device_load(self, r: int, data: st.DataObject) -> None:
        ctx = self.ctxs[r]
        readable = [k for k in UNIVERSE if self._lookup(k, ctx) is HIT]
        if readable:
            keys = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3))
            self._device_load(ctx, keys)

    def _device_load(self, ctx: ReqContext, keys: list[OffloadKey]) -> None:
        """Load host hits ``keys`` to the device (completed by a later rule)."""
        spec = self.manager.prepare_load(keys, ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        for k, slot in zip(keys, spec.block_ids, strict=True):
            assert slot_bytes(self.pool, slot) == content(k), "a host block holds wrong bytes"
        self.device_pins.append((ctx, keys))

    @precondition(lambda self: self.device_pins)
    @rule(i=st.integers(0, 10))
    def complete_device_load(self, i: int) -> None:
        ctx, keys = self.device_pins.pop(i % len(self.device_pins))
        self.manager.complete_load(keys, ctx)

    @rule()
    def step(self) -> None:
        self.manager.step_end()
        self.disk.drain_jobs()  # deterministic: the next draws must not depend on thread timing
        self.manager.step_begin()
        for event in self.manager.take_events():
            target = self.on_disk if event.medium == "STORAGE" else self.in_host
            if event.medium == "STORAGE":
                assert event.locality == "LOCAL"
            if event.removed:
                target.difference_update(event.keys)
            else:
                target.update(event.keys)
        # Replayed events name only blocks each tier holds.
        probe = ReqContext("probe")
        for k in self.in_host:
            assert self.host.lookup(k, probe) is not MISS
        for k in self.on_disk:
            assert self.disk.lookup(k, probe) is not MISS

    @rule(r=st.integers(0, 3))
    def finish_request(self, r: int) -> None:
        ctx = self.ctxs[r]
        if any(c is ctx for c, _ in (*self.device_pins, *self.stores)):
            return
        self.manager.request_finished(ctx)
        self.ctxs[r] = _request(f"{ctx.req_id}+")

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        probe = ReqContext("probe")
        for k in UNIVERSE:
            if self.host.lookup(k, probe) is HIT:
                block = self.host.policy.get(k)
                assert block is not None
                slot = block.slot
                assert slot_bytes(self.pool, slot) == content(k), f"host block {k.hex()} is wrong"
        assert self.disk.stats()["used_blocks"] <= DISK_BLOCKS
        # A block reaches the disk only if a request that allowed it wrote it into the host.
        on_disk = {k for k in UNIVERSE if self.disk.lookup(k, probe) in (HIT, HIT_PENDING)}
        assert on_disk <= self.may_cascade, f"cascaded against kv_store_tiers: {on_disk}"
        # Only blocks seen by MIN_REUSE requests are written; never more writes in flight than
        # the bound.
        unworthy = {k.hex() for k in on_disk if len(self.seen.get(k, ())) < self.MIN_REUSE}
        assert not unworthy, f"written through before {self.MIN_REUSE} requests saw them"
        assert self.manager.stats()["cascade_in_flight_blocks"] <= self.MAX_IN_FLIGHT


class OnEvictTieringMachine(TieringMachine):
    CASCADE = "on_evict"
    EVICT_HEADROOM = 0.75  # 3 of 4 slots: most steps cascade, some blocks are lost first


class BoundedTieringMachine(TieringMachine):
    """One cascade block in flight at a time (the rest wait, and are shed when the host evicts
    them first), and only blocks two requests saw are written."""

    MAX_IN_FLIGHT = 1
    MIN_REUSE = 2


def test_tiering_manager_contract_with_bounded_reused_writes() -> None:
    run_state_machine_as_test(BoundedTieringMachine, settings=SETTINGS)


def test_tiering_manager_contract() -> None:
    run_state_machine_as_test(TieringMachine, settings=SETTINGS)


def test_tiering_manager_contract_on_evict() -> None:
    run_state_machine_as_test(OnEvictTieringMachine, settings=SETTINGS)


# The paths the random runs may or may not reach (whether they do depends on the seed), played
# rule by rule on a fresh machine and checked by its invariant after every rule: each entry is
# the rules to call (lists are UNIVERSE indices) and the counters non-zero once they ran.
# Host: 4 slots; disk: 5 blocks; both LRU.
Script = list[tuple[list[tuple], set[str]]]
WRITE_THROUGH_PATHS: Script = [
    # k0-k2 then k3-k5 reach host and disk; the host evicts k0, k1; the disk evicts k0.
    (
        [
            ("device_store", 0, [0, 1, 2], True),
            ("step",),
            ("device_store", 0, [3, 4, 5], True),
            ("step",),
        ],
        {"cascaded_blocks", "disk_evicted_blocks"},
    ),
    # Host k3-k6, disk k2-k6: req-1 asks for k2, which only the disk has.
    ([("device_store", 0, [6], True), ("step",), ("lookup_chain", 1, [2])], {"retry_answers"}),
    # The promotion lands (evicting k3) and stays pinned for req-1, which has not loaded it.
    ([("step",)], {"promoted_blocks", "pinned_promoted_blocks"}),
    # req-0 loads k4-k6: with k2 pinned the host has no room left; req-2, without promotions
    # of its own, waits for room for k3.
    ([("device_load", 0, [4, 5, 6]), ("lookup_chain", 2, [3])], {"room_waits"}),
    # The load completes: req-2 finds room and queues k3; before the step ends req-0 loads
    # k4-k6 again and takes that room: the promotion is refused, req-2 recomputes k3.
    (
        [
            ("complete_device_load", 0),
            ("step",),
            ("lookup_chain", 2, [3]),
            ("device_load", 0, [4, 5, 6]),
            ("step",),
        ],
        {"refused_promotion_blocks"},
    ),
]
ON_EVICT_PATHS: Script = [
    # Headroom: 3 of 4 slots. k4, k5 evict k0, k1 before any step: lost to the disk.
    (
        [("device_store", 0, [0, 1, 2, 3], True), ("device_store", 0, [4, 5], True)],
        {"cascade_lost_blocks"},
    ),
    # Free slots below the headroom: the oldest dirty blocks (k2-k4) cascade.
    ([("step",)], {"cascaded_blocks"}),
    # k6, k7 evict k2, k3; req-1 asks for k3, which only the disk has.
    ([("device_store", 0, [6, 7], True), ("step",), ("lookup_chain", 1, [3])], {"retry_answers"}),
    ([("step",)], {"promoted_blocks", "pinned_promoted_blocks"}),
]


def play(machine_class: type[TieringMachine], script: Script) -> None:
    """Play ``script`` on a fresh machine; fail where a counter it names is still zero."""
    machine = machine_class()
    try:
        seen: set[str] = set()  # the counters that were non-zero after some rule
        for n, (calls, reached) in enumerate(script):
            for name, *args in calls:
                args = [[UNIVERSE[i] for i in a] if isinstance(a, list) else a for a in args]
                if name == "device_load":  # the rule draws its keys: call what it calls
                    machine._device_load(machine.ctxs[args[0]], args[1])
                else:
                    getattr(machine, name)(*args)
                machine.consistent()
                seen.update(stat for stat, value in machine.manager.stats().items() if value)
            missing = sorted(reached - seen)
            assert not missing, f"entry {n}: {missing} not reached, only {sorted(seen)}"
    finally:
        machine.teardown()


def test_tiering_manager_paths() -> None:
    play(TieringMachine, WRITE_THROUGH_PATHS)


def test_tiering_manager_paths_on_evict() -> None:
    play(OnEvictTieringMachine, ON_EVICT_PATHS)


BOUNDED_PATHS: Script = [
    # req-0 stores k0-k2, seen by it alone: not worth a write yet (cold).
    ([("device_store", 0, [0, 1, 2], True), ("step",)], {"stored_blocks"}),
    # req-1 looks k0-k2 up: now seen twice, they wait for the one write in flight allowed.
    ([("lookup_chain", 1, [0, 1, 2]), ("step",)], {"cascaded_blocks", "cascade_backlog_blocks"}),
    # req-2 stores k3-k6: the host evicts k0 (written), k1, k2 (still waiting: shed); then
    # k0, k1 again evict the never-reused k3, k4 (cold: skipped).
    (
        [
            ("device_store", 2, [3, 4], True),
            ("device_store", 2, [5, 6], True),
            ("device_store", 2, [0, 1], True),
            ("step",),
        ],
        {"shed_cascade_blocks", "disk_shed_store_blocks", "skipped_cascade_blocks"},
    ),
]


def test_tiering_manager_paths_with_bounded_reused_writes() -> None:
    play(BoundedTieringMachine, BOUNDED_PATHS)
