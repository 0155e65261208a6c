"""KV events from inside the engine, received over real ZMQ sockets by a KVEventSubscriber and
applied to a BlockIndex: the index follows blocks from the device cache to the host tier and out
of it, ends equal to what the engine really holds, and every BlockStored describes its blocks."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from engine_cases import (
    BLOCK_SIZE,
    assert_outputs_or_aborted_prefix,
    assert_quiescent,
    assert_same_outputs,
    backing_manager,
    cycling_rounds,
    delay_completions,
    drive,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_mix,
    random_tokens,
    reference_outputs,
    run_rounds,
    tiny_engine,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvoffload.engine import Engine, RequestOutput
from kvoffload.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventSubscriber,
    external_block_hash,
)
from kvoffload.keys import BlockHash, offload_key_hash

TOPIC = "kv"


def _events_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": TOPIC,
    }
    config.update(overrides)
    return config


class Follower:
    """A router's view of one engine: a subscriber feeding a BlockIndex; keeps every event."""

    def __init__(self, engine: Engine) -> None:
        publisher: Any = engine.publisher  # a ZmqEventPublisher: it has endpoints
        self.engine = engine
        self.sub = KVEventSubscriber(
            publisher.endpoint, TOPIC, publisher.replay_endpoint, start_seq=0
        )
        self.index = BlockIndex()
        self.events: list[KVCacheEvent] = []

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sub.close()

    def _take(self, timeout_s: float) -> None:
        while (got := self.sub.receive(timeout_s)) is not None:
            self.index.apply(got.batch)
            self.events.extend(got.batch.events)

    def sync(self) -> None:
        """Apply every batch the engine has published so far (replay fills what live missed)."""
        stats = self.engine.publisher.stats
        deadline = time.monotonic() + 10
        while stats()["sent"] < stats()["published"] and time.monotonic() < deadline:
            time.sleep(0.005)
        self.sub.catch_up()
        self._take(0.05)
        assert self.sub.next_seq == stats()["published"]

    def finish(self) -> None:
        """After the engine closed (its publisher flushed): take the live tail."""
        published = self.engine.publisher.stats()["published"]
        deadline = time.monotonic() + 10
        while (self.sub.next_seq or 0) < published and time.monotonic() < deadline:
            self._take(0.1)
        assert self.sub.next_seq == published
        assert self.sub.stats()["lost"] == 0


def _ext(engine: Engine, h: bytes) -> Any:
    return external_block_hash(h, engine.config.events.int_block_hashes)


def _device_blocks(engine: Engine) -> set:
    return {_ext(engine, b.block_hash) for b in engine.pool.blocks if b.block_hash is not None}


def _tier_blocks(engine: Engine) -> set:
    """The host tier's readable blocks (stored, not being written)."""
    return {
        _ext(engine, offload_key_hash(key))
        for key, block in backing_manager(engine).items()
        if block.ref_cnt >= 0
    }


def _check_self_describing(
    engine: Engine, events: list[KVCacheEvent], outputs: list[RequestOutput]
) -> int:
    """Every BlockStored's hashes are the chained hashes of its token ids from its parent; a block
    announced on both tiers has the same parent and tokens on each. Returns how many were."""
    hasher, ebs = engine.hasher, engine.config.block_size
    known: dict[Any, BlockHash] = {}  # published hash -> hash bytes, for every block we submitted
    for out in outputs:
        for h in hasher.hash_blocks(out.prompt_token_ids + out.output_token_ids):
            known[_ext(engine, h)] = h
    seen: dict[tuple[str, Any], tuple[Any, tuple[int, ...]]] = {}
    described = {MEDIUM_GPU: ebs, MEDIUM_CPU: ebs * engine.config.block_size_factor}
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        medium = event.medium
        assert medium is not None
        assert event.block_size == described[medium]
        assert event.group_idx == 0 and event.lora_name is None
        assert len(event.token_ids) == event.block_size * len(event.block_hashes)
        parent = event.parent_block_hash
        for i, published in enumerate(event.block_hashes):
            tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
            chained = None if parent is None else known[parent]
            # An offloaded block spans block_size_factor engine blocks: chain their hashes.
            for k in range(0, len(tokens), ebs):
                chained = hasher.hash_block(chained, tokens[k : k + ebs])
            assert chained is not None and _ext(engine, chained) == published
            seen[(medium, published)] = (parent, tuple(tokens))
            parent = published
    both = {h for m, h in seen if m == MEDIUM_CPU} & {h for m, h in seen if m == MEDIUM_GPU}
    for h in both:
        (cpu_parent, cpu_tokens), (gpu_parent, gpu_tokens) = (
            seen[(MEDIUM_CPU, h)],
            seen[(MEDIUM_GPU, h)],
        )
        assert cpu_tokens[-ebs:] == gpu_tokens  # an offloaded block ends with the engine block
        if engine.config.block_size_factor == 1:
            assert cpu_parent == gpu_parent
    return len(both)


def test_by_default_hashes_are_published_in_vllms_int_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, ``int_block_hashes`` follows vLLM (ints, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    unset): device and host events carry each block's hash bytes as vLLM's
    ``maybe_convert_block_hash`` reads them, the whole hash big-endian modulo 2**64 (consumers
    such as Dynamo's indexer accept no bytes)."""
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    prompt = random_tokens(random.Random(3), 4 * BLOCK_SIZE)
    engine = tiny_engine(num_device_blocks=8, kv_offloading_size=host_gib(8),
                         kv_events_config=_events_config())
    with engine, Follower(engine) as follower:
        engine.generate([prompt], greedy(2))
        engine.drain()
        follower.sync()
        want = [int.from_bytes(h, "big") % 2**64 for h in engine.hasher.hash_blocks(prompt)]
    stored = {m: [h for e in follower.events if isinstance(e, BlockStored) and e.medium == m
                  for h in e.block_hashes] for m in (MEDIUM_GPU, MEDIUM_CPU)}
    for medium in (MEDIUM_GPU, MEDIUM_CPU):
        assert stored[medium][: len(want)] == want, medium


@pytest.mark.parametrize(("factor", "int_hashes"), [(1, False), (2, True)])
def test_index_follows_blocks_across_tiers(factor: int, int_hashes: bool) -> None:
    rng = random.Random(factor)
    prompt = lambda prefix: prefix + random_tokens(rng, 2)  # noqa: E731
    prefixes = [random_tokens(rng, 6 * BLOCK_SIZE) for _ in range(3)]
    outputs: list[RequestOutput] = []
    engine = tiny_engine(
        num_device_blocks=8,  # one 7-block request at a time
        block_size_factor=factor,
        kv_offloading_size=host_gib(12 // factor, factor=factor),  # two prefixes
        kv_events_config=_events_config(int_block_hashes=int_hashes),
    )
    with engine, Follower(engine) as follower:
        hashes = [[_ext(engine, h) for h in engine.hasher.hash_blocks(p)] for p in prefixes]
        # An offloaded block is published under its last engine block's hash.
        offloaded = [hs[factor - 1 :: factor] for hs in hashes]

        # Prefix 0 is computed, offloaded, then mostly pushed out of the device by prefix 1.
        for p in prefixes[:2]:
            outputs += engine.generate([prompt(p)], greedy(2))
            engine.drain()
        follower.sync()
        on_device = _device_blocks(engine)
        gone_from_device = [h for h in hashes[0] if h not in on_device]
        assert gone_from_device
        for h in gone_from_device:
            assert not follower.index.contains(h, "device")
        for h in offloaded[0]:
            assert follower.index.tiers_of(h) in (["device", "host"], ["host"])
            assert follower.index.contains(h, "host")
        assert any(isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU for e in follower.events)

        # Prefix 2 fills the (two-prefix) host tier: prefix 0, least recently used, leaves it.
        outputs += engine.generate([prompt(prefixes[2])], greedy(2))
        engine.drain()
        follower.sync()
        for h in offloaded[0]:
            assert not follower.index.contains(h, "host")
        assert any(isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for e in follower.events)

        # Prefix 1 comes back from the host tier.
        again = engine.generate([prompt(prefixes[1])], greedy(2))
        outputs += again
        assert again[0].cached_tokens_offload > 0
        assert_quiescent(engine)
        follower.sync()
        assert follower.index.blocks("host") == _tier_blocks(engine)
        assert follower.index.blocks("device") == _device_blocks(engine)
        want_cpu, want_gpu = _tier_blocks(engine), _device_blocks(engine)
        engine.close()  # flushes the publisher (closing again on exit is a no-op)
        follower.finish()
        assert follower.index.blocks("host") == want_cpu
        assert follower.index.blocks("device") == want_gpu
        assert _check_self_describing(engine, follower.events, outputs) > 0


def test_events_under_cycling_load_end_equal_to_engine() -> None:
    """Many steps of loads, stores and evictions on both tiers. After round 1 the subscriber is
    caught up; the later rounds' batches reach it live, the last ones flushed by the engine's
    close: the index ends equal to what the engine held after its drain."""
    rounds = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=3, seed=21)
    with (
        tiny_engine(
            num_device_blocks=24,
            max_num_seqs=2,
            kv_offloading_size=host_gib(36),  # round 1's blocks, then evictions
            kv_events_config=_events_config(),
        ) as engine,
        Follower(engine) as follower,
    ):
        outputs = list(run_rounds(engine, rounds[:1], greedy())[0])
        follower.sync()
        outputs += [o for r in run_rounds(engine, rounds[1:], greedy()) for o in r]
        stats = engine.stats()
        assert stats["offload_tier_evicted_blocks"] > 0 and stats["device_evicted_blocks"] > 0
        assert stats["offload_loaded_blocks"] > 0
        assert_quiescent(engine)
        want_cpu, want_gpu = _tier_blocks(engine), _device_blocks(engine)
        engine.close()
        follower.finish()
        assert follower.sub.stats()["received"] > 0  # the tail came live, not through replay
        assert follower.index.blocks("host") == want_cpu
        assert follower.index.blocks("device") == want_gpu
        assert _check_self_describing(engine, follower.events, outputs) > 0
    assert_same_outputs(outputs, reference_outputs([p for r in rounds for p in r], greedy()))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    num_device_blocks=st.integers(12, 24),
    host_blocks=st.integers(4, 24),
    factor=st.sampled_from([1, 2]),
    store_policy=st.sampled_from(["on_compute", "on_finish", "prompt_only"]),
    aborts=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 60)), max_size=3),
    delays=st.lists(st.integers(0, 4), min_size=1, max_size=5),
)
@example(  # the failing example of issue 9: a load lands in the step its request is preempted
    seed=7483,
    num_device_blocks=14,
    host_blocks=8,
    factor=2,
    store_policy="on_compute",
    aborts=[(9, 25)],
    delays=[0],
)
@example(  # deterministic: every load lands 3 steps late, into the step it is preempted
    seed=13399,
    num_device_blocks=17,
    host_blocks=4,
    factor=1,
    store_policy="on_compute",
    aborts=[(8, 0), (6, 43)],
    delays=[3],
)
@example(  # a tier of 4 blocks: a block is stored, evicted and planned again in one step
    seed=1,
    num_device_blocks=12,
    host_blocks=4,
    factor=1,
    store_policy="on_compute",
    aborts=[],
    delays=[0],
)
@example(  # two finished requests' kept offers, each larger than the tier, must not take turns
    seed=1,  # evicting each other for ever (the drain ends)
    num_device_blocks=24,
    host_blocks=4,
    factor=1,
    store_policy="on_compute",
    aborts=[],
    delays=[0],
)
def test_random_mix_index_follows_engine_every_step(
    seed: int,
    num_device_blocks: int,
    host_blocks: int,
    factor: int,
    store_policy: str,
    aborts: list[tuple[int, int]],
    delays: list[int],
) -> None:
    """Random requests, preemptions, aborts and transfers completing ``delays`` steps late (job
    ``j`` after ``delays[j % len(delays)]`` steps, deterministically): after every step the index
    holds exactly the engine's device cache and host tier, every stored event describes its
    blocks, and the outputs are those of a run without events or offloading."""
    prompts, params = random_mix(seed)
    with (
        tiny_engine(
            num_device_blocks=num_device_blocks,
            max_num_seqs=4,
            block_size_factor=factor,
            kv_offloading_size=host_gib(host_blocks, factor=factor),
            store_policy=store_policy,
            kv_events_config=_events_config(),
        ) as engine,
        Follower(engine) as follower,
    ):
        delay_completions(engine, lambda job_id: delays[job_id % len(delays)])

        def check_index() -> None:
            follower.sync()
            assert follower.index.blocks("device") == _device_blocks(engine)
            assert follower.index.blocks("host") == _tier_blocks(engine)

        aborts_at = {step: i for i, step in aborts}
        ids, done = drive(engine, prompts, params, aborts_at, after_step=check_index)
        assert_quiescent(engine)
        check_index()
        _check_self_describing(engine, follower.events, list(done.values()))
    assert_outputs_or_aborted_prefix(ids, done, reference_outputs(prompts, params))


def test_absent_or_slow_subscriber_never_blocks_the_engine() -> None:
    """No subscriber, a one-batch queue and a one-message high-water mark: the run completes with
    the right output, and every published batch is either sent or counted as dropped."""
    rounds = cycling_rounds(num_prefixes=3, prefix_blocks=4, num_rounds=2, seed=4)
    config = _events_config(max_queue_size=1, hwm=1, replay_endpoint=None)
    with tiny_engine(
        num_device_blocks=16,
        max_num_seqs=2,
        kv_offloading_size=host_gib(16),
        kv_events_config=config,
    ) as engine:
        outputs = [o for r in run_rounds(engine, rounds, greedy()) for o in r]
        assert_quiescent(engine)
    stats = engine.publisher.stats()
    assert stats["published"] > 0 and stats["queued"] == 0
    assert (
        stats["published"]
        == stats["sent"] + stats["dropped"] + stats["encode_errors"] + stats["send_errors"]
    )
    assert stats["encode_errors"] == 0
    assert_same_outputs(outputs, reference_outputs([p for r in rounds for p in r], greedy()))


def test_slow_subscriber_never_blocks_the_engine() -> None:
    """A subscriber that reads nothing while the engine runs (receive buffer of one message)."""
    rounds = cycling_rounds(num_prefixes=3, prefix_blocks=4, num_rounds=2, seed=5)
    with tiny_engine(
        num_device_blocks=16,
        max_num_seqs=2,
        kv_offloading_size=host_gib(16),
        kv_events_config=_events_config(hwm=1, replay_endpoint=None),
    ) as engine:
        publisher: Any = engine.publisher
        sub = KVEventSubscriber(publisher.endpoint, TOPIC, hwm=1)
        outputs = [o for r in run_rounds(engine, rounds, greedy()) for o in r]
        assert_quiescent(engine)
    received = list(sub.iter_batches(timeout_s=0.5))
    sub.close()
    assert len(received) <= engine.publisher.stats()["published"]
    assert_same_outputs(outputs, reference_outputs([p for r in rounds for p in r], greedy()))
