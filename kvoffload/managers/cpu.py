"""The host-memory tier's manager: a fixed pool of slots ordered by a pluggable eviction policy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import filterfalse
from operator import attrgetter

from kvoffload.errors import ConfigError, ContractError
from kvoffload.eviction import EvictionPolicy, OffloadedBlock, RequestUses, create_eviction_policy
from kvoffload.eviction._request_state import request_state, take_request_state
from kvoffload.eviction.base import PENDING, overrides
from kvoffload.keys import OffloadKey
from kvoffload.load_store_specs import CPULoadStoreSpec
from kvoffload.manager_contract import (
    EventQueueMixin,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)

__all__ = ["CPUOffloadingManager"]

# Bound once: enum attribute lookups cost more than the dict lookup they report on.
_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_slot_of = attrgetter("slot")
_NO_USES = RequestUses()  # what a policy that does not read the request's access gets (read-only)


class CPUOffloadingManager(EventQueueMixin, OffloadingManager):
    """Bookkeeping of ``num_blocks`` host slots, each holding one offloaded block.

    Slots: never-used ids are handed out in ascending order first (a bump pointer), then freed
    ids last-in first-out, each with the record that held it (once a block has left, its record
    is reused for a later block in the same slot). Invariants (checked by
    :meth:`check_invariants`): every slot below the bump pointer is either free or owned by
    exactly one key; the pool never holds more than ``num_blocks`` blocks; pending and pinned
    blocks are never evicted.

    Events (only when ``enable_events``): one removal event per ``prepare_store`` that evicted,
    one stored event per ``complete_store(success=True)`` that made blocks readable, removals of
    every readable block on :meth:`reset`; failed stores emit nothing (they were never announced).

    Requests (only for policies with the request hooks, :mod:`kvoffload.eviction.base`): as vLLM
    0.33's manager, it records each request's *access* (:class:`RequestUses`: the keys it loads,
    and the keys it offers to store that it stores or finds stored and ready), tells the policy
    of store misses (once per request and key) before evicting for them, and hands the record
    over at :meth:`request_finished`; records made before a :meth:`reset` are dropped.

    Counters from :meth:`stats`: ``capacity_blocks``, ``used_blocks`` (gauges); ``stored_blocks``,
    ``failed_store_blocks``, ``loaded_blocks``, ``evicted_blocks``, ``rejected_stores`` (prepare_store
    answered ``None``), ``not_admitted_blocks`` (declined by the policy).
    """

    medium = "CPU"

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str | EvictionPolicy = "adaptive",
        enable_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(
                "num_blocks", f"the tier needs at least one block, got {num_blocks!r}"
            )
        policy = (
            create_eviction_policy(eviction_policy, num_blocks)
            if isinstance(eviction_policy, str)
            else eviction_policy
        )
        self._policy = policy
        self._get = policy.get
        # The optional hooks are skipped entirely (not called as no-ops) for policies that leave
        # them alone, and a request's access is recorded only for policies that read it.
        self._admit = policy.admit if overrides(policy, "admit") else None
        self._missed = policy.store_missed if overrides(policy, "store_missed") else None
        self._accessed = policy.request_accessed if overrides(policy, "request_accessed") else None
        self._commit = policy.request_finished if overrides(policy, "request_finished") else None
        self._reads = self._commit is not None and policy.reads_access
        self._records = self._reads or self._accessed is not None or self._missed is not None
        self._generation = 0  # bumped by reset(): a request's record from before it is dropped
        self._num_blocks = num_blocks
        self._num_allocated = 0  # bump pointer over never-used slot ids
        # Records of freed slots (each keeps its slot id), reused LIFO for the next blocks stored.
        self._free: list[OffloadedBlock] = []
        # Blocks with ref_cnt == 0: lets prepare_store refuse in O(1) when the tier is all pending
        # or pinned, instead of the policy scanning every block before answering None.
        self._num_evictable = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._stored = self._failed = self._loaded = self._evicted = 0
        self._rejected = self._not_admitted = 0

    @property
    def num_blocks(self) -> int:
        """The capacity of the tier, in blocks."""
        return self._num_blocks

    @property
    def num_reclaimable(self) -> int:
        """Slots a :meth:`prepare_store` could fill now: free ones plus evictable blocks (ready,
        unpinned). O(1)."""
        return self._num_blocks - len(self._policy) + self._num_evictable

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy ordering this tier."""
        return self._policy

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        block = self._get(key)
        if block is None:
            return _MISS
        return _HIT if block.ref_cnt >= 0 else _HIT_PENDING

    def holds(self, key: OffloadKey, ctx: ReqContext) -> bool:
        """Whether ``lookup`` is not ``MISS``, without its answer (the admission order probes
        every waiting request's blocks each step)."""
        return self._get(key) is not None

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        spec = self.pin(keys)
        self._loaded += len(keys)
        if self._records and keys:  # a load is the request's access, of reused blocks
            loaded = list(keys)
            if self._accessed is not None and ctx.offload_key_positions:
                self._accessed(loaded, ctx)
            if self._reads:
                uses = request_state(ctx, self, RequestUses, self._generation)
                uses.runs.append((loaded, loaded, ()))
        return spec

    def pin(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        """Pin readable blocks against eviction, as :meth:`prepare_load` does but not counted as
        a load (for readers that are not loads to the device: cascades to secondary tiers,
        promotions held for their request); :meth:`complete_load` releases the pins."""
        blocks = list(map(self._get, keys))
        evictable = self._num_evictable
        for block in blocks:
            if block is None or block.ref_cnt < 0:
                break
            if not block.ref_cnt:
                evictable -= 1
            block.ref_cnt += 1
        else:
            self._num_evictable = evictable
            return CPULoadStoreSpec(list(map(_slot_of, blocks)))
        # A key is not loadable: release the pins taken before it (it fails again, pinned or not).
        bad = next(i for i, block in enumerate(blocks) if block is None or block.ref_cnt < 0)
        for block in blocks[:bad]:
            block.ref_cnt -= 1  # type: ignore[union-attr]  # blocks before bad: all held
        state = "absent" if blocks[bad] is None else "still being written"
        raise ContractError(
            f"prepare_load: block {keys[bad].hex()} is {state}; only HIT blocks can be loaded"
        )

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._policy.touch(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.unpin(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        """Release one pin per key taken by :meth:`pin` or :meth:`prepare_load` (what
        :meth:`complete_load` does); a key not pinned raises before any pin is released."""
        blocks = list(map(self._get, keys))
        released = 0
        for i, block in enumerate(blocks):
            if block is None or block.ref_cnt <= 0:
                for done in blocks[:i]:
                    done.ref_cnt += 1  # type: ignore[union-attr]  # before i: all held
                raise ContractError(
                    f"complete_load: block {keys[i].hex()} is not pinned by a prepare_load"
                )
            block.ref_cnt -= 1
            if not block.ref_cnt:
                released += 1
        self._num_evictable += released

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        # The keys offered, each once, in order (a key listed twice is stored once): also the
        # protected set of an eviction. The absent ones in one C-level pass (a record is truthy).
        offered = dict.fromkeys(keys)
        to_store = list(filterfalse(self._get, offered))
        num_held = len(offered) - len(to_store)
        if self._admit is not None and to_store:
            admitted = self._admit(to_store, keys, ctx)
            self._not_admitted += len(to_store) - len(admitted)
            to_store = admitted
        if not self._records:
            return self._store(to_store, offered, ctx)
        uses = request_state(ctx, self, RequestUses, self._generation)
        if self._missed is not None and to_store:
            missed = uses.first_misses(to_store)  # once per request and key, as vLLM's manager
            if missed:
                self._missed(missed, ctx)
        # The request's access, as vLLM records it: what it stores or finds stored and ready.
        ready = self._ready_among(offered) if num_held else []
        access = to_store if not ready else self._access_of(offered, to_store, ready)
        if access and self._accessed is not None and ctx.offload_key_positions:
            self._accessed(access, ctx)
        out = self._store(to_store, offered, ctx)
        if access and self._reads:
            uses.runs.append((access, ready, to_store if out is not None else ()))
        return out

    def _ready_among(self, offered: dict[OffloadKey, None]) -> list[OffloadKey]:
        get = self._get
        return [k for k in offered if (b := get(k)) is not None and b.ref_cnt >= 0]

    @staticmethod
    def _access_of(
        offered: dict[OffloadKey, None], to_store: list[OffloadKey], ready: list[OffloadKey]
    ) -> list[OffloadKey]:
        wanted = {*to_store, *ready}
        return [k for k in offered if k in wanted]

    def _store(
        self, to_store: list[OffloadKey], offered: dict[OffloadKey, None], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve slots for ``to_store`` (evicting what is needed, ``offered`` protected)."""
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])

        free = self._free
        n = len(to_store)
        n_fresh = self._num_blocks - self._num_allocated
        need = n - (n_fresh + len(free))
        evicted: list[OffloadKey] = []
        if need > 0:
            victims = self._policy.evict(need, offered) if need <= self._num_evictable else None
            if victims is None:
                self._rejected += 1
                return None
            self._num_evictable -= need
            evicted = [key for key, _ in victims]
            free += [block for _, block in victims]
            self._evicted += need
            if self._events is not None:  # shares the list with the output (both read-only)
                self._events.append(OffloadingEvent(evicted, self.medium, True))

        # Never-used slot ids first (ascending), then freed ones last-in first-out, each with the
        # record that held it (a fresh record costs an allocation and a slot store per block).
        n_fresh = min(n_fresh, n)
        if n_fresh:
            first = self._num_allocated
            self._num_allocated += n_fresh
            new_block = OffloadedBlock.__new__
            blocks = []
            for slot in range(first, first + n_fresh):
                block = new_block(OffloadedBlock)
                block.slot = slot
                blocks.append(block)
            n_reused = n - n_fresh
            if n_reused:
                blocks += free[: -n_reused - 1 : -1]
                del free[-n_reused:]
        else:
            blocks = free[: -n - 1 : -1]
            del free[-n:]
        for block in blocks:
            block.ref_cnt = PENDING
        self._policy.insert_n(to_store, blocks, ctx)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(list(map(_slot_of, blocks))), evicted)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        if success:
            stored: list[OffloadKey] = []
            for key, block in zip(keys, map(self._get, keys), strict=True):
                if block is not None and block.ref_cnt < 0:
                    block.ref_cnt = 0
                    stored.append(key)
            self._stored += len(stored)
            self._num_evictable += len(stored)
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(stored, self.medium, False))
        else:
            get, remove = self._get, self._policy.remove
            for key in keys:
                block = get(key)
                if block is not None and block.ref_cnt < 0:
                    remove(key)
                    self._free.append(block)
                    self._failed += 1

    def request_finished(self, ctx: ReqContext) -> None:
        """Hand the policy what the request loaded and offered to store, so that it commits that
        use (vLLM's ``on_request_finished``)."""
        gen = self._generation
        uses = take_request_state(ctx, self, RequestUses, gen) if self._records else None
        if self._commit is not None:
            self._commit(uses if uses is not None and self._reads else _NO_USES, ctx)

    def drop_evictable(self) -> list[OffloadKey]:
        """Remove every evictable block now (ready and unpinned: pinned, pending and loading
        blocks stay), as evictions are removed: one removal event, ``evicted_blocks`` counted.
        Returns the keys removed. O(blocks held): an operator's clear, not a hot path."""
        victims = self._policy.evict(self._num_evictable, ()) if self._num_evictable else []
        if not victims:
            return []
        self._num_evictable -= len(victims)
        self._free += [block for _, block in victims]
        self._evicted += len(victims)
        keys = [key for key, _ in victims]
        if self._events is not None:
            self._events.append(OffloadingEvent(keys, self.medium, True))
        return keys

    def reset(self) -> None:
        get = self._get
        # Keys of the policy are held (get() is not None).
        readable = [k for k in self._policy if get(k).ref_cnt >= 0]  # type: ignore[union-attr]
        self._policy.clear()
        self._generation += 1
        self._free.clear()
        self._num_allocated = 0
        self._num_evictable = 0
        if readable and self._events is not None:
            self._events.append(OffloadingEvent(readable, self.medium, True))

    def stats(self) -> dict[str, int]:
        return {
            "capacity_blocks": self._num_blocks,
            "used_blocks": len(self._policy),
            "stored_blocks": self._stored,
            "failed_store_blocks": self._failed,
            "loaded_blocks": self._loaded,
            "evicted_blocks": self._evicted,
            "rejected_stores": self._rejected,
            "not_admitted_blocks": self._not_admitted,
        }

    def items(self) -> Iterator[tuple[OffloadKey, OffloadedBlock]]:
        """Iterate over ``(key, block)`` of every held block. O(blocks held): tooling and tests."""
        get = self._get
        for key in list(self._policy):
            yield key, get(key)  # type: ignore[misc]  # a key of the policy: held

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if slot accounting or the policy is inconsistent."""
        owners: dict[int, OffloadKey] = {}
        for key, block in self.items():
            assert block is not None, f"policy iterates {key.hex()} but get() misses it"
            assert block.ref_cnt >= -1, f"{key.hex()}: ref_cnt {block.ref_cnt}"
            assert 0 <= block.slot < self._num_allocated, (
                f"{key.hex()}: slot {block.slot} never allocated"
            )
            assert block.slot not in owners, f"slot {block.slot} owned by two keys"
            owners[block.slot] = key
        free = {block.slot for block in self._free}
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert not free & owners.keys(), "a slot is both free and owned"
        assert len(owners) + len(free) == self._num_allocated <= self._num_blocks, "slots leaked"
        evictable = sum(1 for _, block in self.items() if block.ref_cnt == 0)
        assert self._num_evictable == evictable, (
            f"evictable count {self._num_evictable} != {evictable}"
        )
        self._policy.check_invariants()
