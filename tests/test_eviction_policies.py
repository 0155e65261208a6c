"""Eviction policies: one contract suite every registered policy passes, then each policy's order.

``PolicyContract`` is the mixin (cachetools style): a subclass per policy sets ``name`` and runs
every contract test. The policy-specific classes below it pin the exact eviction rule of each.
Blocks are made ready (``ref_cnt = 0``) by hand, as the manager would on ``complete_store``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import ReqContext
from kvoffload.eviction import (
    AdaptivePolicy,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    OffloadedBlock,
    PrefixPolicy,
    RequestUses,
    S3FIFOPolicy,
    available_eviction_policies,
    create_eviction_policy,
    register_eviction_policy,
)
from kvoffload.keys import OffloadKey, make_offload_key

K = [make_offload_key(i.to_bytes(8, "big")) for i in range(64)]


def ctx(name: str = "r") -> ReqContext:
    return ReqContext(name)


def fill(
    policy: EvictionPolicy, keys: Sequence[OffloadKey], ref_cnt: int = 0
) -> dict[OffloadKey, OffloadedBlock]:
    """Insert ``keys`` with fresh slots, all in state ``ref_cnt``; return the blocks."""
    blocks: dict[OffloadKey, OffloadedBlock] = {}
    for key in keys:
        block = OffloadedBlock(len(policy) + len(blocks) + 1000)
        policy.insert(key, block)
        block.ref_cnt = ref_cnt
        blocks[key] = block
    return blocks


def state(policy: EvictionPolicy) -> dict[OffloadKey, tuple[int, int]]:
    return {key: (policy.get(key).slot, policy.get(key).ref_cnt) for key in policy}  # type: ignore[union-attr]


def drain(policy: EvictionPolicy) -> list[OffloadKey]:
    """Evict one block at a time until nothing is evictable: the full eviction order."""
    order = []
    while (victims := policy.evict(1, ())) is not None:
        order += [key for key, _ in victims]
    return order


class PolicyContract:
    """What every policy promises (kvoffload/eviction/base.py)."""

    name: str

    def make(self, capacity: int = 8) -> EvictionPolicy:
        return create_eviction_policy(self.name, capacity)

    def test_registered_under_its_name(self) -> None:
        assert self.name in available_eviction_policies()
        assert type(self.make()).name == self.name

    def test_insert_get_len_iter(self) -> None:
        p = self.make()
        blocks = fill(p, K[:3])
        assert len(p) == 3 and set(p) == set(K[:3])
        for key, block in blocks.items():
            assert p.get(key) is block
        assert p.get(K[9]) is None
        p.check_invariants()

    def test_remove_forgets_the_block(self) -> None:
        p = self.make()
        fill(p, K[:3], ref_cnt=-1)
        p.remove(K[1])
        assert p.get(K[1]) is None and len(p) == 2 and set(p) == {K[0], K[2]}
        p.check_invariants()

    def test_touch_ignores_unknown_keys(self) -> None:
        p = self.make()
        fill(p, K[:2])
        p.touch([K[5], K[0], K[6]], ctx())
        assert set(p) == {K[0], K[1]}
        p.check_invariants()

    def test_get_changes_no_order(self) -> None:
        p, twin = self.make(), self.make()
        for policy in (p, twin):
            fill(policy, K[:4])
            policy.touch(K[2:4], ctx())
        for key in K[:4]:
            p.get(key)
        assert drain(p) == drain(twin)

    def test_evict_returns_exactly_n_and_removes_them(self) -> None:
        p = self.make()
        blocks = fill(p, K[:5])
        victims = p.evict(3, ())
        assert victims is not None and len(victims) == 3
        assert len({key for key, _ in victims}) == 3
        for key, block in victims:
            assert blocks[key] is block and p.get(key) is None
        assert len(p) == 2
        assert p.evict(0, ()) == []
        p.check_invariants()

    def test_evict_skips_pinned_pending_and_protected_blocks(self) -> None:
        p = self.make()
        fill(p, K[:2], ref_cnt=1)  # pinned by a load
        fill(p, K[2:4], ref_cnt=-1)  # being written
        fill(p, K[4:7])
        victims = p.evict(2, {K[4]})
        assert victims is not None
        assert {key for key, _ in victims} == {K[5], K[6]}
        assert p.evict(1, {K[4]}) is None

    def test_evict_is_atomic(self) -> None:
        """Asking for more than is evictable returns None and leaves no trace: a twin that never
        saw the call evicts in exactly the same order afterwards."""
        p, twin = self.make(), self.make()
        for policy in (p, twin):
            fill(policy, K[:2], ref_cnt=1)
            fill(policy, K[2:6])
            policy.touch([K[3], K[4]], ctx("a"))
            policy.touch([K[4]], ctx("b"))
        before = state(p)
        assert p.evict(5, {K[5]}) is None
        assert state(p) == before
        p.check_invariants()
        assert drain(p) == drain(twin)

    def test_the_lone_evictable_block_is_found_though_it_was_used_again(self) -> None:
        """Every other block pinned, the one evictable block used since its store: eviction must
        still take it. (S3-FIFO scanned main first, found it done, then moved the used block from
        small to main's tail, which it never scanned again: evict returned None. It takes a target
        size of small above 1, hence the capacity.)"""
        p = self.make(40)
        fill(p, K[:1])
        p.touch(K[:1], ctx("a"))
        fill(p, K[1:2])
        assert p.evict(1, ()) is not None
        for key in p:
            p.get(key).ref_cnt = 1  # type: ignore[union-attr]
        fill(p, K[2:3])
        p.touch(K[2:3], ctx("b"))
        victims = p.evict(1, ())
        assert victims is not None and [key for key, _ in victims] == [K[2]]
        p.check_invariants()

    def test_insert_n_is_insert_one_by_one(self) -> None:
        """The batch insert leaves the policy as inserting each key in turn would: the same order
        and the same use of remembered keys (ghosts), checked by draining twins."""
        p, twin = self.make(4), self.make(4)
        for policy in (p, twin):
            fill(policy, K[:4])
            policy.touch(K[:2], ctx("a"))
            assert policy.evict(3, ()) is not None  # some leave into the policy's history
        keys = [key for key in K[:8] if p.get(key) is None][:3]
        blocks = [OffloadedBlock(100 + i) for i in range(len(keys))]
        p.insert_n(keys, blocks)
        fill(twin, keys, ref_cnt=-1)
        for block in blocks:
            block.ref_cnt = 0
        for key in keys:
            twin.get(key).ref_cnt = 0  # type: ignore[union-attr]
        p.check_invariants()
        assert [p.get(key) for key in keys] == blocks
        assert drain(p) == drain(twin)

    def test_clear_forgets_everything(self) -> None:
        p = self.make()
        fill(p, K[:4])
        p.clear()
        assert len(p) == 0 and list(p) == [] and p.get(K[0]) is None
        p.check_invariants()
        fill(p, K[:2])
        assert set(p) == {K[0], K[1]}


class TestLRUContract(PolicyContract):
    name = "lru"


class TestARCContract(PolicyContract):
    name = "arc"


class TestS3FIFOContract(PolicyContract):
    name = "s3fifo"


class TestAdaptiveContract(PolicyContract):
    name = "adaptive"


class TestPrefixContract(PolicyContract):
    name = "prefix"


@pytest.mark.parametrize("name", available_eviction_policies())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.lists(st.integers(0, 15), max_size=6)), max_size=40
    )
)
def test_random_operations_keep_invariants(name: str, ops: list[tuple[int, list[int]]]) -> None:
    """insert / remove / touch / pin / evict in any order against a model of the held set."""
    p = create_eviction_policy(name, 6)
    model: dict[OffloadKey, OffloadedBlock] = {}
    contexts = [ctx(f"r{i}") for i in range(3)]
    for op, ids in ops:
        keys = [K[i] for i in ids]
        if op == 0:  # insert absent keys (a store being prepared)
            for key in dict.fromkeys(keys):
                if key not in model and len(model) < 6:
                    model[key] = fill(p, [key], ref_cnt=-1)[key]
        elif op == 1:  # complete or fail stores
            for key in keys:
                if key in model and model[key].ref_cnt < 0:
                    if ids[0] % 2:
                        model[key].ref_cnt = 0
                    else:
                        p.remove(key)
                        del model[key]
        elif op == 2:
            p.touch(keys, contexts[len(ids) % 3])
        elif op == 3:  # pin or unpin
            for key in keys:
                if key in model and model[key].ref_cnt >= 0:
                    model[key].ref_cnt = 1 - min(model[key].ref_cnt, 1)
        else:
            n = len(ids) % 4
            protected = set(keys[:2])
            evictable = {k for k, b in model.items() if b.ref_cnt == 0 and k not in protected}
            victims = p.evict(n, protected)
            if victims is None:
                assert len(evictable) < n
            else:
                assert len(victims) == n
                for key, block in victims:
                    assert key in evictable and model.pop(key) is block
        assert {key: p.get(key) for key in p} == model
        p.check_invariants()


def test_every_registered_policy_has_a_contract_class() -> None:
    tested = {cls.name for cls in PolicyContract.__subclasses__()}
    assert set(available_eviction_policies()) <= tested


def test_a_second_class_cannot_take_a_registered_name() -> None:
    class Impostor(LRUPolicy):
        name = "lru"

    with pytest.raises(ValueError, match="already registered"):
        register_eviction_policy(Impostor)


# ------------------------------------------------------------------------------------------ LRU


class TestLRUOrder:
    def test_touch_makes_the_first_key_most_recent(self) -> None:
        """Stored 0 1 2 3; touch([0, 1, 2]) walks tail to head, so the order becomes 3 2 1 0."""
        p = LRUPolicy(8)
        fill(p, K[:4])
        p.touch(K[:3], ctx())
        assert drain(p) == [K[3], K[2], K[1], K[0]]

    def test_oldest_evictable_goes_first(self) -> None:
        p = LRUPolicy(8)
        fill(p, K[:3])
        p.get(K[0]).ref_cnt = 1  # type: ignore[union-attr]
        victims = p.evict(1, ())
        assert victims is not None and victims[0][0] == K[1]

    def test_a_request_with_key_positions_keeps_its_keys_at_its_place(self) -> None:
        """vLLM's request rank: request 1 (positions 16, 32 for keys 0 and 2) takes its place at
        its first access, raising held key 0 to it; key 1, stored by another request after that,
        is newer than key 2, which request 1 stores last; within the place, the tail goes first.
        (Checked against vLLM's ``LRUCachePolicy``: 3 2 0 1.)"""
        p = LRUPolicy(8)
        first = ctx("first")
        first.set_offload_key_position(K[0], 16)
        first.set_offload_key_position(K[2], 32)
        fill(p, [K[3], K[0]])
        p.request_accessed([K[0]], first)
        fill(p, [K[1]])
        p.insert(K[2], OffloadedBlock(99, 0), first)
        p.check_invariants()
        assert drain(p) == [K[3], K[2], K[0], K[1]]
        p.check_invariants()

    def test_a_key_used_after_a_request_took_its_place_stays_newer(self) -> None:
        """The request's access raises only keys older than its place: key 1, touched after
        request 1 took its place, stays newer when request 1 then accesses it (vLLM: 2 0 1)."""
        p = LRUPolicy(8)
        first = ctx("first")
        first.set_offload_key_position(K[0], 16)
        first.set_offload_key_position(K[1], 32)
        fill(p, [K[2], K[0], K[1]])
        p.request_accessed([K[0]], first)
        p.touch([K[1]], ctx("other"))
        p.request_accessed([K[1]], first)
        p.check_invariants()
        assert drain(p) == [K[2], K[0], K[1]]

    def test_a_finished_request_renews_its_chain_tail_first(self) -> None:
        """Finish walks what the request loaded and offered (stored or found ready), tail to
        head: its place closes and the head ends newest."""
        p = LRUPolicy(8)
        request = ctx("r")
        for i in range(3):
            request.set_offload_key_position(K[i], 16 * (i + 1))
        fill(p, [K[0], K[5]])
        uses = RequestUses()
        uses.runs = [([K[0]], [K[0]], ())]
        p.request_accessed([K[0]], request)
        for key in K[1:3]:
            p.insert(key, OffloadedBlock(90 + len(p), 0), request)
        uses.runs.append((K[1:3], (), K[1:3]))
        p.request_finished(uses, request)
        p.check_invariants()
        assert drain(p) == [K[5], K[2], K[1], K[0]]


# ------------------------------------------------------------------------------------------ ARC


class TestARCOrder:
    def test_touch_promotes_only_ready_blocks(self) -> None:
        """A pending block touched stays in T1 (its own store put it there); a ready one moves to T2."""
        p = ARCPolicy(8)
        fill(p, [K[0]], ref_cnt=-1)
        fill(p, [K[1]])
        p.touch([K[0], K[1]], ctx())
        assert list(p._t1) == [K[0]] and list(p._t2) == [K[1]]

    def test_every_touch_of_a_ready_block_is_a_use(self) -> None:
        """As vLLM's ``touch``: no once-per-request rule; the request that stored a block promotes
        it by touching it once it is ready."""
        p = ARCPolicy(8)
        first = ctx("first")
        fill(p, [K[0]], ref_cnt=-1)
        p.touch([K[0]], first)
        assert list(p._t1) == [K[0]]
        p.get(K[0]).ref_cnt = 0  # type: ignore[union-attr]
        p.touch([K[0]], first)
        assert list(p._t2) == [K[0]]

    def test_a_finished_request_promotes_what_it_reused_not_what_it_stored(self) -> None:
        """vLLM's ``on_request_finished``: a ready block the request loaded or offered again moves
        to T2; a block it only stored keeps its list (recency within it, tail first)."""
        p = ARCPolicy(8)
        fill(p, K[:4])
        uses = RequestUses()
        uses.runs = [(K[:2], K[:2], ()), (K[2:4], (), K[2:4])]  # loads 0 1, stores 2 3
        p.request_finished(uses, ctx())
        assert list(p._t2) == [K[1], K[0]] and list(p._t1) == [K[3], K[2]]

    def test_ghost_hits_move_the_target(self) -> None:
        """T1 victims go to B1, T2 victims to B2; a store miss of a B1 key raises the target, of
        a B2 key lowers it, and so does touching a ghost key (vLLM's ``on_store_miss`` and
        ``touch``); storing it again puts it in T1. (The manager counts a store miss once per
        request and key: test_eviction_chain_order.py.)"""
        p = ARCPolicy(4)
        fill(p, K[:4])
        p.touch([K[2], K[3]], ctx("a"))  # tail to head: T1 = 0 1, T2 = 3 2
        victims = p.evict(1, ())  # |T1| = 2 >= max(1, target 0): T1's oldest
        assert victims is not None and victims[0][0] == K[0] and list(p._b1) == [K[0]]
        p.touch([K[0]], ctx("b"))  # a ghost hit: target += max(1, |B2| / |B1|) = 1
        assert p.target == 1.0 and list(p._b1) == [K[0]]
        p.target = 0.0
        victims = p.evict(2, ())  # T1 = 1 >= 1: key 1 to B1; T1 empty: T2's oldest, 3, to B2
        assert victims is not None and [key for key, _ in victims] == [K[1], K[3]]
        assert list(p._b1) == [K[0], K[1]] and list(p._b2) == [K[3]]
        request = ctx("c")
        p.store_missed([K[0]], request)  # B1: target += max(1, |B2| / |B1|) = 1
        assert p.target == 1.0 and list(p._b1) == [K[1], K[0]]
        fill(p, [K[0]])
        assert list(p._b1) == [K[1]] and K[0] in p._t1
        p.target = 3.0
        p.store_missed([K[3]], request)  # B2: target -= max(1, |B1| / |B2|) = 1
        assert p.target == 2.0
        p.target = 4.0
        p.store_missed([K[1]], ctx("d"))  # B1, clamped at the capacity
        assert p.target == 4.0
        p.check_invariants()

    def test_a_remembered_key_comes_back_into_t1(self) -> None:
        """As in vLLM: a ghost key stored again is a new block of T1 (a later use promotes it)."""
        p = ARCPolicy(2)
        fill(p, K[:2])
        assert p.evict(1, ()) is not None
        p.store_missed([K[0]], ctx())
        fill(p, [K[0]])
        assert K[0] in p._t1 and K[0] not in p._b1 and p.target == 1.0

    def test_ghost_lists_are_bounded_by_capacity(self) -> None:
        p = ARCPolicy(3)
        for i in range(0, 30, 3):
            fill(p, K[i : i + 3])
            assert p.evict(3, ()) is not None
            assert len(p._b1) <= 3 and len(p._b2) <= 3
            p.check_invariants()

    def test_eviction_prefers_t1_while_it_exceeds_the_target(self) -> None:
        p = ARCPolicy(8)
        fill(p, K[:4])
        p.touch([K[0], K[1]], ctx())  # T1 = 2 3, T2 = 1 0
        p.target = 1.0
        victims = p.evict(3, ())
        # T1 has 2 >= 1: take 2; T1 has 1 >= 1: take 3; T1 empty: T2's oldest, 1.
        assert victims is not None and [key for key, _ in victims] == [K[2], K[3], K[1]]


# ------------------------------------------------------------------------------------- S3-FIFO


class TestS3FIFOOrder:
    def test_one_hit_wonders_leave_from_small_into_ghost(self) -> None:
        p = S3FIFOPolicy(10)  # small target 1
        fill(p, K[:3])
        victims = p.evict(2, ())
        assert victims is not None and [key for key, _ in victims] == [K[0], K[1]]
        assert list(p._ghost) == [K[0], K[1]]

    def test_a_block_used_again_moves_to_main_instead(self) -> None:
        p = S3FIFOPolicy(10)
        fill(p, K[:3])
        p.touch([K[0]], ctx("second request"))
        victims = p.evict(1, ())
        assert victims is not None and victims[0][0] == K[1]
        assert list(p._main) == [K[0]] and p._main[K[0]].freq == 0

    def test_main_reinserts_used_blocks_with_one_less_frequency(self) -> None:
        p = S3FIFOPolicy(10)
        fill(p, K[:3])
        p.touch(K[:3], ctx("a"))
        p.touch([K[0]], ctx("b"))
        # Small target 1: 0 1 2 move to main (all used), then main: 0 (freq 0) is the oldest.
        assert p.evict(1, ()) is not None
        assert list(p._small) == [] and list(p._main) == [K[1], K[2]]
        # One more use of 1: it is reinserted behind 2, which then goes first.
        p.touch([K[1]], ctx("c"))
        victims = p.evict(1, ())
        assert victims is not None and victims[0][0] == K[2]
        assert p._main[K[1]].freq == 0

    def test_a_remembered_key_enters_main(self) -> None:
        p = S3FIFOPolicy(10)
        fill(p, K[:2])
        assert p.evict(1, ()) is not None
        fill(p, [K[0]])
        assert K[0] in p._main and K[0] not in p._ghost

    def test_a_request_counts_once(self) -> None:
        p = S3FIFOPolicy(10)
        fill(p, [K[0]])
        c = ctx()
        p.touch([K[0]], c)
        p.touch([K[0]], c)
        assert p._small[K[0]].freq == 1

    def test_ghost_is_bounded_by_capacity(self) -> None:
        p = S3FIFOPolicy(3)
        for i in range(0, 30, 3):
            fill(p, K[i : i + 3])
            assert p.evict(3, ()) is not None
            assert len(p._ghost) <= 3


# ------------------------------------------------------------------------------------- adaptive


class TestAdaptiveOrder:
    def test_the_history_is_longer_than_the_tier(self) -> None:
        """S3-FIFO forgets a key after ``capacity`` later one-hit wonders; ``adaptive`` remembers
        ``history_factor`` x ``capacity`` of them, so a block that comes back after that many new
        blocks still enters main."""
        for name, expected in (("s3fifo", "small"), ("adaptive", "main")):
            p = create_eviction_policy(name, 4)
            fill(p, [K[0]])
            for i in range(1, 9):  # 8 newer blocks pass through, each evicting the oldest
                assert p.evict(1, ()) is not None
                fill(p, [K[i]])
            assert K[0] not in p
            fill(p, [K[0]])
            assert K[0] in getattr(p, f"_{expected}"), name

    def test_the_history_is_bounded(self) -> None:
        """Two generations: the newer spans fewer than ``history_size`` evictions from small, the
        older at most that plus one call's victims."""
        p = AdaptivePolicy(3, history_factor=2)
        for i in range(0, 60, 3):
            fill(p, K[i : i + 3])
            assert p.evict(3, ()) is not None
            assert len(p._ghost) < 6 and len(p._old_ghost) <= 6 + 3 and len(p._main_ghost) <= 3
            p.check_invariants()

    @pytest.mark.parametrize(("later", "enters"), [(5, "main"), (6, "small")])
    def test_a_key_is_remembered_for_history_size_evictions(self, later: int, enters: str) -> None:
        """However the generations fall, a key that left small fewer than ``history_size``
        (here 6) evictions ago is remembered; one that left 6 or more ago is new again."""
        p = AdaptivePolicy(2, history_factor=3)
        fill(p, [K[0]])
        assert p.evict(1, ()) is not None
        for i in range(1, later + 1):  # one-hit wonders pass through small
            fill(p, [K[i]])
            assert [k for k, _ in p.evict(1, ()) or []] == [K[i]]
        fill(p, [K[0]])
        assert K[0] in getattr(p, f"_{enters}")
        p.check_invariants()

    def test_the_reach_is_how_long_main_keeps_a_block(self) -> None:
        """Little's law: a block admitted to main stays about len(main) / (main's eviction rate),
        counted in evictions from small. Once main turns over faster than a remembered key took
        to come back, the key is new again (probation), while a fresher one still enters main."""
        p = AdaptivePolicy(4, history_factor=3)  # history 12, small target 1
        for key in K[0], K[1]:  # K0 then K1 leave small unused: evictions from small 1 and 2
            fill(p, [key])
            assert [k for k, _ in p.evict(1, ()) or []] == [key]
        assert p.reach == 12  # main has evicted nothing yet: the whole history counts
        fill(p, K[2:6])
        p.touch(K[2:6], ctx("reuse"))  # all four used again: promoted to main on the next evict
        expected = [(K[2], 3 * 2 / 1), (K[3], 2 * 2 / 2), (K[4], 1 * 2 / 3)]
        for key, reach in expected:  # main evicts 3 times while small evicted twice
            assert [k for k, _ in p.evict(1, ()) or []] == [key]
            assert p.reach == pytest.approx(reach)
        fill(p, [K[0]])  # left small 1 eviction ago: beyond the reach of 2/3
        fill(p, [K[1]])  # left 0 evictions ago: within it
        assert K[0] in p._small and K[1] in p._main
        p.check_invariants()

    def test_a_key_that_a_larger_small_would_have_kept_grows_it(self) -> None:
        p = AdaptivePolicy(512, initial_small=2 / 512)  # small target 2, step 1
        fill(p, K[:3])
        assert [k for k, _ in p.evict(1, ()) or []] == [K[0]]  # small holds 3 >= 2: K0 leaves
        fill(p, [K[0]])  # it left 1 eviction ago, < target 2: a larger small would have hit
        assert p.small_target == 3.0 and K[0] in p._main

    def test_a_key_that_a_larger_main_would_have_kept_shrinks_small(self) -> None:
        p = AdaptivePolicy(512, initial_small=4 / 512)  # small target 4, step 1
        fill(p, K[:2])
        p.touch(K[:2], ctx("reuse"))
        p.small_target = 1.0
        assert p.evict(2, ()) is not None  # both promoted to main... then evicted from it
        p.small_target = 4.0
        assert list(p._main_ghost) == [K[0], K[1]]
        fill(p, [K[1]])  # left main 0 evictions ago, < target 4
        assert p.small_target == 3.0 and K[1] in p._main and not p._main_ghost.get(K[1])

    def test_a_key_list_touched_twice_by_a_request_counts_once(self) -> None:
        p = AdaptivePolicy(8)
        fill(p, K[:2])
        c = ctx()
        chain = K[:2]
        p.touch(chain, c)
        p.touch(chain, c)  # the scheduler re-touches the same list every step
        assert p._small[K[0]].freq == 1
        p.touch(chain, ctx("another request"))
        assert p._small[K[0]].freq == 2


# -------------------------------------------------------------------------------------- prefix


def learned_admission(own_blocks_come_back: bool) -> list[OffloadKey]:
    """A 2-block tier holding a hot chain is offered a new request's 2 blocks, after a history
    in which either the hot chain is reused by every request and each request's own blocks never
    again, or the other way round. Returns what the policy admits."""
    hot = K[:2]
    p = PrefixPolicy(2, history_size=64, num_ages=8)
    next_id = 1000
    for i in range(p.recompute_every // 4):
        own = [make_offload_key(j.to_bytes(8, "big")) for j in (next_id, next_id + 1)]
        next_id += 2
        if own_blocks_come_back:
            p.touch(own, ctx(f"a{i}"))
            p.touch(own, ctx(f"b{i}"))
        else:
            p.touch([*hot, *own], ctx(f"a{i}"))
    fill(p, hot)
    new = [make_offload_key(j.to_bytes(8, "big")) for j in (9000, 9001)]
    request = ctx("offer")
    p.touch([*hot, *new], request)  # the hot chain is a hit; only the new blocks are offered
    return p.admit(new, new, request)


class TestPrefixOrder:
    def test_only_leaves_are_evicted_and_a_chain_goes_tail_first(self) -> None:
        p = PrefixPolicy(8)
        p.touch(K[:4], ctx())  # teaches the chain 0 -> 1 -> 2 -> 3
        fill(p, K[:4])
        assert drain(p) == [K[3], K[2], K[1], K[0]]

    def test_one_call_can_eat_a_whole_chain(self) -> None:
        """Parents whose children were all chosen become candidates within the same call."""
        p = PrefixPolicy(8)
        p.touch(K[:3], ctx())
        fill(p, K[:3])
        victims = p.evict(3, ())
        assert victims is not None and [key for key, _ in victims] == [K[2], K[1], K[0]]
        p.check_invariants()

    def test_interior_blocks_go_when_every_leaf_is_pinned(self) -> None:
        p = PrefixPolicy(8)
        p.touch(K[:2], ctx())
        fill(p, K[:2])
        p.get(K[1]).ref_cnt = 1  # type: ignore[union-attr]
        victims = p.evict(1, ())
        assert victims is not None and victims[0][0] == K[0]
        assert p.density(K[1]) == -1.0  # its prefix is gone: it can never be hit
        p.check_invariants()

    def test_a_failed_store_leaves_an_orphan_that_goes_first(self) -> None:
        p = PrefixPolicy(8)
        p.touch(K[:3], ctx())
        fill(p, K[:3])
        p.get(K[1]).ref_cnt = -1  # type: ignore[union-attr]
        p.remove(K[1])  # its store failed; 2 hangs from a missing block
        p.check_invariants()
        victims = p.evict(1, ())
        assert victims is not None and victims[0][0] == K[2]

    def test_admits_everything_while_there_is_room(self) -> None:
        p = PrefixPolicy(8)
        assert p.admit(K[:5], K[:5], ctx()) == K[:5]

    def test_a_full_tier_admits_anything_before_it_has_learned(self) -> None:
        p = PrefixPolicy(2)
        fill(p, K[:2])
        request = ctx()
        p.touch([*K[:2], K[60]], request)
        assert p.admit([K[60]], [K[60]], request) == [K[60]]  # every density is still 0

    def test_admits_everything_when_nothing_could_be_displaced(self) -> None:
        """The offered chain protects the held blocks: evict() will answer, not admit()."""
        p = PrefixPolicy(2)
        fill(p, K[:2])
        assert p.admit([K[60]], [*K[:2], K[60]], ctx()) == [K[60]]

    def test_a_full_tier_refuses_blocks_that_history_says_are_worth_less(self) -> None:
        """Hot chain reused, first-seen blocks never: the new blocks would displace more value."""
        assert learned_admission(own_blocks_come_back=False) == []

    def test_the_admission_threshold_follows_the_data(self) -> None:
        """Same tier, same offer, but first-seen blocks have been coming back: admitted."""
        new = [make_offload_key(j.to_bytes(8, "big")) for j in (9000, 9001)]
        assert learned_admission(own_blocks_come_back=True) == new

    def test_a_chain_whose_prefix_is_not_held_is_not_admitted_when_full(self) -> None:
        p = PrefixPolicy(1)
        p.touch(K[:3], ctx())
        fill(p, [K[5]])
        assert p.admit([K[2]], [K[2]], ctx("b")) == []  # 2's parent, 1, is not held

    def test_the_last_block_of_a_chain_has_its_own_class(self) -> None:
        p = PrefixPolicy(8)
        p.touch(K[:3], ctx())
        held = p._history
        assert [held[k].cls % 2 for k in K[:3]] == [0, 0, 1]

    def test_history_is_bounded(self) -> None:
        p = PrefixPolicy(2, history_size=16)
        for i in range(10):
            p.touch(K[i * 4 : i * 4 + 4], ctx(f"r{i}"))
            assert len(p._history) <= 16
        p.check_invariants()

    def test_kv_cache_groups_are_separate_chains(self) -> None:
        """Keys of two groups in one call: no parent link or chain tail crosses the groups."""
        g0 = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(2)]
        g1 = [make_offload_key(i.to_bytes(8, "big"), 1) for i in range(2)]
        p = PrefixPolicy(8)
        p.touch([*g0, *g1], ctx())
        h = p._history
        assert h[g1[0]].parent_key is None and h[g1[1]].parent_key == g1[0]
        assert [h[k].cls % 2 for k in (*g0, *g1)] == [0, 1, 0, 1]

    def test_two_policies_sharing_a_request_context_count_independently(self) -> None:
        """Tiers share one ReqContext per request; each policy counts the request once."""
        a, b = PrefixPolicy(8), PrefixPolicy(8)
        c = ctx()
        for policy in (a, b, a, b):
            policy.touch(K[:2], c)
        assert a._history[K[0]].count == b._history[K[0]].count == 1
