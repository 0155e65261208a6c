"""The router's prefix index: keyed by token content across instances and tiers, in both wire
forms of the events; and, per step of a deterministic two-engine run over real ZMQ sockets, equal
to what each engine's device cache, host tier and disk tier really hold, and what the Redis server
they share holds."""

from __future__ import annotations

import random
import time

import pytest
import redis
from engine_cases import (
    BLOCK_SIZE,
    backing_manager,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_tokens,
    tiny_engine,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_servers import standalone_server

from kvoffload import LookupResult, ReqContext, make_offload_key
from kvoffload.engine import Engine
from kvoffload.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    KVEventBatch,
    external_block_hash,
)
from kvoffload.keys import OffloadKey, offload_key_hash
from kvoffload.routing.follower import EventFollower
from kvoffload.routing.prefix_index import DEVICE, DISK, HOST, REMOTE, HeldKey, Match, PrefixIndex
from kvoffload.routing.prefix_keys import block_keys, token_bytes
from kvoffload.serving.server import remote_tier_id
from kvoffload.tiers.disk.tier import DiskTier
from kvoffload.tiers.redis.tier import RedisTier, remote_key_prefix

BS = 4


def _stored(hashes, parent, tokens, medium="GPU", locality=None, size=BS):
    return BlockStored(hashes, parent, tokens, size, None, medium, None, locality=locality)


def _roundtrip(events, legacy: bool):
    payload = EventEncoder(legacy_array_events=legacy).encode(KVEventBatch(0.0, events))
    return EventDecoder().decode(payload).events


@pytest.mark.parametrize("legacy", [False, True])
def test_keys_are_content_hashes_in_both_wire_forms(legacy: bool) -> None:
    tokens = list(range(3 * BS + 2))
    keys = list(block_keys(token_bytes(tokens), BS))
    assert len(keys) == 3
    index = PrefixIndex(BS)
    a, b = index.add_instance(), index.add_instance()
    # Engine hashes differ per instance (a seeded hash): the keys do not.
    index.apply(a, _roundtrip([_stored([11, 12], None, tokens[: 2 * BS])], legacy))
    index.apply(a, _roundtrip([_stored([13], 12, tokens[2 * BS : 3 * BS])], legacy))
    index.apply(b, _roundtrip([_stored([21], None, tokens[:BS])], legacy))
    # An offloaded block of two engine blocks, announced under its last engine block's hash.
    index.apply(b, _roundtrip([_stored([22], 21, tokens[BS : 3 * BS], "CPU", size=2 * BS)], legacy))
    m = index.match(token_bytes(tokens), [a, b])
    assert (m[a].device, m[a].computed) == (3, 0)
    assert (m[b].device, m[b].host, m[b].computed) == (1, 2, 0)
    # A token-less event reuses the keys learned for that engine hash.
    index.apply(a, [_stored([12], None, [], "CPU", size=0)])
    index.apply(a, [BlockRemoved([11, 12, 13], "GPU")])
    assert index.match(token_bytes(tokens), [a])[a].host == 0  # block 0 gone: no prefix
    index.apply(a, [_stored([11], None, tokens[:BS], "STORAGE", "LOCAL")])
    one = index.match(token_bytes(tokens), [a])[a]
    assert (one.disk, one.host, one.computed) == (1, 1, 1)
    index.apply(b, [AllBlocksCleared()])
    assert index.match(token_bytes(tokens), [b])[b].cached == 0  # device run gone, host from 1
    assert index.held(b, HOST) == {(0, 22)}
    index.apply(b, [_stored([99], 98, tokens[:BS])])  # parent never seen
    assert index.counters["unknown_parent"] == 1


def test_remote_blocks_count_for_every_instance_sharing_the_tier() -> None:
    tokens = list(range(2 * BS))
    index = PrefixIndex(BS)
    a, b, c = index.add_instance("redis://x/0"), index.add_instance("redis://x/0"), index.add_instance()
    index.apply(a, [_stored([1, 2], None, tokens, "STORAGE", "REMOTE")])
    m = index.match(token_bytes(tokens), [a, b, c])
    assert m[a].remote == m[b].remote == 2 and m[c].cached == 0
    index.remove_instance(a)
    assert index.match(token_bytes(tokens), [b])[b].cached == 0
    assert index.num_keys() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 7), st.booleans()),
                max_size=60))
def test_index_equals_the_union_of_what_was_stored_and_not_removed(ops) -> None:
    """Random stores and removals on 3 instances x 4 tiers of 8 chained blocks (their parents known
    from an earlier instance, which left; two instances share a remote group): the index holds
    exactly the surviving (instance, tier, block) triples, a key maps to them, and every prompt
    prefix matches as the engine would use the blocks (:func:`_model_match`)."""
    tokens = list(range(8 * BS))
    keys = list(block_keys(token_bytes(tokens), BS))
    index = PrefixIndex(BS)
    seed = index.add_instance()  # teaches the index every engine hash's key, then leaves
    index.apply(seed, [_stored([100 + b for b in range(8)], None, tokens)])
    index.remove_instance(seed)
    groups = ["g", "g", None]
    ids = [index.add_instance(g) for g in groups]
    mediums = [("GPU", None), ("CPU", None), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")]
    want: set[tuple[int, int, int]] = set()
    for inst, tier, block, store in ops:
        medium, locality = mediums[tier]
        if store:
            parent = None if block == 0 else 100 + block - 1
            index.apply(ids[inst], [_stored([100 + block], parent,
                                            tokens[block * BS : (block + 1) * BS], medium, locality)])
            want.add((inst, tier, block))
        else:
            index.apply(ids[inst], [BlockRemoved([100 + block], medium, locality=locality)])
            want.discard((inst, tier, block))
    for inst in range(3):
        for tier in (DEVICE, HOST, DISK, REMOTE):
            assert index.held(ids[inst], tier) == {
                (0, 100 + b) for i, t, b in want if (i, t) == (inst, tier)
            }
    assert index.num_keys() == len({b for _, _, b in want})
    assert set(index.keys()) == {keys[b] for _, _, b in want}
    for length in (1, 4, 8):
        got = index.match(token_bytes(tokens[: length * BS + 1]), ids)
        for inst in range(3):
            assert got[ids[inst]] == _model_match(want, groups, inst, length), (inst, length)


def _model_match(want: set, groups: list, inst: int, length: int) -> Match:
    """The engine's use of an instance's blocks, spelled out: a device run from block 0, then
    each block from its host, its disk, or a remote tier it shares (or its own), until a block
    it cannot get."""
    m = Match(total=length)
    for b in range(length):
        has = {t for i, t, blk in want if i == inst and blk == b}
        shared = groups[inst] is not None and any(
            t == REMOTE and groups[i] == groups[inst] for i, t, blk in want if blk == b)
        if DEVICE in has and m.cached == m.device:
            m.device += 1
        elif HOST in has:
            m.host += 1
        elif DISK in has:
            m.disk += 1
        elif REMOTE in has or shared:
            m.remote += 1
        else:
            break
    return m


# -- a deterministic two-engine run, checked after every step -------------------------------------


#: The engines publish int block hashes (the default, as vLLM's); the index holds what they publish.
INT_HASHES = True


def _events_config() -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv", "int_block_hashes": INT_HASHES}


class _Followed:
    def __init__(self, engine: Engine, index: PrefixIndex, remote_group: str) -> None:
        self.engine = engine
        self.iid = index.add_instance(remote_group)
        assert engine.tiering is not None
        self.remote = next(t for t in engine.tiering.tiers if isinstance(t, RedisTier))
        publisher = engine.publisher
        self.follower = EventFollower(
            "e", publisher.endpoint, publisher.replay_endpoint, "kv",
            apply=lambda evs: index.apply(self.iid, evs), reset=lambda: index.clear(self.iid),
        ).start()

    def sync(self) -> None:
        stats = self.engine.publisher.stats
        deadline = time.monotonic() + 30
        while self.follower.next_seq < stats()["published"]:
            assert time.monotonic() < deadline, "the follower did not catch up"
            time.sleep(0.002)

    def writing(self) -> set[HeldKey]:
        """Blocks whose Redis store the engine has not applied yet (so not announced): the
        scheduler thread's own state, read on that thread between steps."""
        return {_held_key(k) for k in self.remote._answers.writing}


def _held_key(key: bytes) -> HeldKey:
    return (0, external_block_hash(offload_key_hash(OffloadKey(key)), INT_HASHES))


def _expected(engine: Engine, prompts: list[list[int]], claimed: set) -> dict[int, set]:
    """What the engine holds per tier; the disk is asked about every prompt block and every
    block the index ``claimed`` (output tokens complete blocks too)."""
    ext = lambda h: external_block_hash(h, INT_HASHES)  # noqa: E731
    device = {(0, ext(b.block_hash)) for b in engine.pool.blocks if b.block_hash is not None}
    host = {(0, ext(k[:-4])) for k, blk in backing_manager(engine).items() if blk.ref_cnt >= 0}
    assert engine.tiering is not None
    disk_tier = next(t for t in engine.tiering.tiers if isinstance(t, DiskTier))
    ctx = ReqContext("check")
    candidates = {h for prompt in prompts for h in engine.hasher.hash_blocks(prompt)}
    # A claimed hash is published (an int): its bytes are those of a key the disk tier knows; a
    # claim of a block it does not know is not a candidate, so a wrong claim still fails.
    raw_of = {ext(offload_key_hash(k)): offload_key_hash(k) for k in disk_tier._policy}
    candidates |= {raw_of[h] for _, h in claimed if h in raw_of}
    disk = {(0, ext(h)) for h in candidates
            if disk_tier.lookup(make_offload_key(h), ctx) is LookupResult.HIT}
    return {DEVICE: device, HOST: host, DISK: disk}


class _SharedTier:
    """The blocks on the shared Redis server, read with a client of the test's own."""

    def __init__(self, url: str, tier: RedisTier) -> None:
        self.client = redis.Redis.from_url(url)
        self.prefix = remote_key_prefix(tier.layout)

    def blocks(self) -> set[HeldKey]:
        n = len(self.prefix)
        return {_held_key(k[n:]) for k in self.client.scan_iter(match=self.prefix + b"*",
                                                                 count=1000)}


def _check_shared(index: PrefixIndex, followed: list[_Followed], shared: _SharedTier,
                  exact: bool) -> set[HeldKey]:
    """The index's REMOTE entries, over every instance, are blocks the server holds; every
    block the server holds is announced, unless an engine's store of it is still unapplied
    (``exact``: none may be)."""
    announced = set().union(*(index.held(f.iid, REMOTE) for f in followed))
    on_server = shared.blocks()
    assert announced <= on_server
    unapplied = set() if exact else set().union(*(f.writing() for f in followed))
    assert on_server - announced <= unapplied
    return announced


def test_router_index_equals_the_engines_caches_after_every_step(tmp_path) -> None:
    """Two engines with their own device cache, host tier and disk, and one Redis server both
    use as their shared tier: after every step, each engine's device, host and disk entries in
    the index are exactly what it holds, and the REMOTE entries of both are what the server holds
    (blocks whose store an engine has not applied yet aside: they are not announced yet)."""
    rng = random.Random(5)
    prefixes = [random_tokens(rng, 6 * BLOCK_SIZE) for _ in range(4)]
    prompts = [p + random_tokens(rng, 3) for p in prefixes for _ in range(2)]
    rng.shuffle(prompts)
    index = PrefixIndex(BLOCK_SIZE)
    with standalone_server() as server:
        engines = [
            tiny_engine(num_device_blocks=10, kv_offloading_size=host_gib(12),
                        kv_disk_path=str(tmp_path / f"d{i}"), kv_disk_size=0.01,
                        kv_remote_url=server.url, kv_events_config=_events_config())
            for i in range(2)
        ]
        group = remote_tier_id(server.url)
        assert group is not None
        followed = [_Followed(e, index, group) for e in engines]
        shared = _SharedTier(server.url, followed[0].remote)
        ran: list[set[int]] = [set(), set()]  # prefixes each engine ran
        try:
            steps = 0
            for n, prompt in enumerate(prompts):
                engines[n % 2].add_request(prompt, greedy(3, logprobs=None))
                ran[n % 2].add(next(i for i, p in enumerate(prefixes) if prompt[: len(p)] == p))
                for _ in range(2):  # admitted while others run
                    for f in followed:
                        connector = f.engine.connector
                        assert connector is not None
                        if f.engine.has_unfinished() or connector.has_pending_jobs():
                            f.engine.step()
                            steps += 1
                        f.sync()
                        want = _expected(f.engine, prompts, index.held(f.iid, DISK))
                        for tier, blocks in want.items():
                            assert index.held(f.iid, tier) == blocks, (steps, tier)
                    _check_shared(index, followed, shared, exact=False)
            for f in followed:
                f.engine.drain()
                f.sync()
                want = _expected(f.engine, prompts, index.held(f.iid, DISK))
                assert want[HOST] and want[DISK]  # the run did reach both offloading tiers
                for tier, blocks in want.items():
                    assert index.held(f.iid, tier) == blocks
            assert _check_shared(index, followed, shared, exact=True)  # and the shared one
            for f in followed:
                for prompt in prompts:
                    # Content keys: what one engine holds on its device is matched from the
                    # prompt's tokens.
                    hashes = [external_block_hash(h, INT_HASHES)
                              for h in f.engine.hasher.hash_blocks(prompt)]
                    run = 0
                    while run < len(hashes) and (0, hashes[run]) in index.held(f.iid, DEVICE):
                        run += 1
                    assert index.match(token_bytes(prompt), [f.iid])[f.iid].device == run
            # A prefix only one engine ran is a REMOTE hit for the other.
            only = [(f, p) for f, mine, theirs in ((followed[0], ran[0], ran[1]),
                                                   (followed[1], ran[1], ran[0]))
                    for i, p in enumerate(prefixes) if i in theirs and i not in mine]
            assert only and all(index.match(token_bytes(p), [f.iid])[f.iid].remote > 0
                                for f, p in only)
        finally:
            for f in followed:
                f.follower.stop()
                f.engine.close()
            shared.client.close()
