"""The remote tier against a real standalone ``redis-server``: round trips between two tiers,
asynchronous lookups, verified loads (garbage, truncation, foreign layouts, vanished values),
server-side eviction and expiry, credentials, and a server that dies and comes back."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
from redis_servers import RedisServer, standalone_server
from remote_cases import (
    fill_random,
    job,
    keys_for,
    lookup_all,
    make_layout,
    make_pool,
    make_tier,
    run_job,
    wait_jobs,
    wait_until,
)

from kvoffload import ReqContext
from kvoffload.errors import ConfigError
from kvoffload.manager_contract import LookupResult
from kvoffload.tiers.blockformat import encode_header, payload_checksum
from kvoffload.tiers.contract import ResultSignal
from kvoffload.tiers.redis.answers import RemoteAnswers
from kvoffload.tiers.redis.tier import VALUE_ALIGN, RedisTier, RemoteTierConfig, remote_key_prefix

HIT, MISS, RETRY, PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)


@pytest.fixture
def two_tiers(redis_server: RedisServer):
    """Two tiers (two "engines") of one layout on one server, with 16-slot pools."""
    layout = make_layout()
    pools = [make_pool(16), make_pool(16)]
    tiers = [make_tier(redis_server.url, view, layout) for _, view in pools]
    yield tiers, [tensor for tensor, _ in pools]
    for tier in tiers:
        tier.close()


def test_blocks_stored_by_one_tier_load_in_another(two_tiers) -> None:
    (a, b), (pool_a, pool_b) = two_tiers
    fill_random(pool_a)
    keys = keys_for(8)
    result = run_job(a, True, keys, list(range(8)))
    assert result.success and result.num_bytes == 8 * pool_a.shape[1]
    (event,) = a.take_events()
    assert event.keys == keys and event.medium == "STORAGE" and not event.removed
    assert a.lookup(keys[0], ReqContext("r")) is HIT  # its own stores answer at once

    assert b.lookup(keys[0], ReqContext("r")) is RETRY  # not known yet: asked in the background
    assert lookup_all(b, keys) == [HIT] * 8
    result = run_job(b, False, keys[::-1], list(range(8, 16)))
    assert result.success and b.stats()["loaded_blocks"] == 8
    assert torch.equal(pool_b[8:16], pool_a[:8].flip(0))
    assert a.stats()["stored_blocks"] == 8 and b.stats()["lookups_sent"] == 8


def test_unknown_keys_are_misses_and_asked_once(two_tiers) -> None:
    (a, _), _ = two_tiers
    keys = keys_for(50, salt=1)
    ctx = ReqContext("r")
    assert {a.lookup(key, ctx) for key in keys} == {RETRY}
    assert lookup_all(a, keys) == [MISS] * 50
    stats = a.stats()
    assert stats["lookups_sent"] == 50  # every key asked exactly once
    assert stats["lookup_round_trips"] >= 1 and stats["lookup_round_trip_us"] > 0  # timed
    assert a.lookup(keys[0], ctx) is MISS  # the remote miss is believed for miss_ttl_s


def test_store_is_pending_until_written_and_repeats_are_skipped(two_tiers) -> None:
    (a, _), (pool_a, _) = two_tiers
    fill_random(pool_a, seed=3)
    keys = keys_for(4, salt=2)
    a.submit_store(job(keys, [0, 1, 2, 3]))
    assert {a.lookup(key, ReqContext("r")) for key in keys} <= {PENDING, HIT}
    a.submit_store(job(keys, [4, 5, 6, 7]))  # the same keys again: skipped, reported stored
    results = wait_jobs(a, 2)
    assert all(r.success for r in results)
    assert a.stats()["stored_blocks"] == 4
    assert lookup_all(a, keys) == [HIT] * 4


def _corrupt_values(server: RedisServer, prefix: bytes, keys: Sequence[bytes], block: int) -> None:
    """keys[0]: garbage; keys[1]: truncated; keys[2]: another layout's block under our key;
    keys[3]: a payload bit flipped; keys[4]: deleted."""
    with server.client() as c:
        c.set(prefix + keys[0], b"not a block at all")
        value = c.get(prefix + keys[1])
        c.set(prefix + keys[1], value[: len(value) // 2])
        other = make_layout()
        payload = bytes(block)
        header = encode_header(
            other.fingerprint(), keys[2], block, payload_checksum(payload), VALUE_ALIGN
        )
        c.set(prefix + keys[2], header + payload)
        value = bytearray(c.get(prefix + keys[3]))
        value[-1] ^= 1
        c.set(prefix + keys[3], bytes(value))
        c.delete(prefix + keys[4])


def test_bad_values_fail_their_loads_with_a_cause(two_tiers, redis_server: RedisServer) -> None:
    (a, b), (pool_a, pool_b) = two_tiers
    fill_random(pool_a, seed=5)
    keys = keys_for(6, salt=3)
    assert run_job(a, True, keys, list(range(6))).success
    _corrupt_values(redis_server, remote_key_prefix(b.layout), keys, pool_a.shape[1])
    assert lookup_all(b, keys) == [HIT, HIT, HIT, HIT, MISS, HIT]
    b.take_events()
    loaded = [0, 1, 2, 3, 5]
    result = run_job(b, False, [keys[i] for i in loaded], loaded)
    assert result.failed_keys == {
        keys[0]: "corrupt",
        keys[1]: "corrupt",
        keys[2]: "layout",
        keys[3]: "checksum",
    }
    assert torch.equal(pool_b[5], pool_a[5])  # the intact block loaded
    assert not pool_b[:3].any()  # a bad header or length: the payload never reaches the slot
    stats = b.stats()
    assert stats["failed_load_corrupt"] == 2 and stats["failed_load_layout"] == 1
    assert stats["failed_load_checksum"] == 1 and stats["failed_load_blocks"] == 4
    (event,) = b.take_events()
    assert event.removed and set(event.keys) == set(keys[:4])
    assert b.lookup(keys[0], ReqContext("r")) is RETRY  # forgotten, asked again
    assert lookup_all(b, keys[:4]) == [MISS] * 4  # and deleted from the server


def test_a_value_that_vanished_is_a_missing_load(two_tiers, redis_server: RedisServer) -> None:
    (a, _), (pool_a, _) = two_tiers
    fill_random(pool_a, seed=6)
    keys = keys_for(3, salt=4)
    assert run_job(a, True, keys, [0, 1, 2]).success
    with redis_server.client() as c:
        c.delete(remote_key_prefix(a.layout) + keys[1])
    result = run_job(a, False, keys, [3, 4, 5])
    assert result.failed_keys == {keys[1]: "missing"}
    assert a.stats()["vanished_blocks"] == 1


def test_layouts_are_namespaced(two_tiers, redis_server: RedisServer) -> None:
    (a, _), (_pool_a, _) = two_tiers
    keys = keys_for(2, salt=5)
    assert run_job(a, True, keys, [0, 1]).success
    _, view = make_pool(4)
    other = make_tier(redis_server.url, view, make_layout())
    try:
        assert lookup_all(other, keys) == [MISS, MISS]
    finally:
        other.close()


def test_server_eviction_is_a_miss_and_counted() -> None:
    block = 64 * 1024
    with standalone_server(
        extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    ) as server:
        tensor, view = make_pool(128, block)
        fill_random(tensor, seed=7)
        tier = make_tier(server.url, view, make_layout(block_bytes=block), stats_interval_s=0.05)
        try:
            keys = keys_for(128, salt=6)
            for start in range(0, 128, 16):  # 8 MiB into a 4 MiB server
                assert run_job(tier, True, keys[start : start + 16], list(range(start, start + 16)))
            wait_until(lambda: tier.stats()["evicted_blocks"] > 0, "the server's eviction count")
            stats = tier.stats()
            assert 0 < stats["capacity_bytes"] <= 4 * 2**20 and stats["used_blocks"] < 128
            before = tensor.clone()
            tensor.zero_()
            result = run_job(tier, False, keys, list(range(128)))
            missing = [i for i, key in enumerate(keys) if key in result.failed_keys]
            assert missing and set(result.failed_keys.values()) == {"missing"}
            present = [i for i in range(128) if i not in missing]
            assert torch.equal(tensor[present], before[present])
            assert tier.stats()["vanished_blocks"] == len(missing)
        finally:
            tier.close()


def test_a_full_server_without_eviction_refuses_stores() -> None:
    block = 64 * 1024
    with standalone_server(
        extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    ) as server:
        _tensor, view = make_pool(64, block)
        tier = make_tier(server.url, view, make_layout(block_bytes=block))
        try:
            result = run_job(tier, True, keys_for(64, salt=7), list(range(64)))
            assert "full" in result.failed_keys.values()
            assert tier.stats()["failed_store_full"] == len(result.failed_keys)
        finally:
            tier.close()


def test_ttl_is_set_on_the_server(redis_server: RedisServer) -> None:
    _tensor, view = make_pool(2)
    layout = make_layout()
    tier = make_tier(redis_server.url, view, layout, ttl_s=600)
    try:
        keys = keys_for(2, salt=8)
        assert run_job(tier, True, keys, [0, 1]).success
        with redis_server.client() as c:
            assert 0 < c.pttl(remote_key_prefix(layout) + keys[0]) <= 600_000
    finally:
        tier.close()


def test_known_hits_expire_with_the_server_ttl(redis_server: RedisServer) -> None:
    """Issue 18, defect 3: with a TTL, a hit the tier learned (by storing the block, or from the
    server's answer) is forgotten once the server expired the block: the key is asked again and
    stored again (before: a HIT forever, and the store skipped as "held")."""
    layout = make_layout()
    (pool, view), (_, writer_view) = make_pool(4), make_pool(4)
    fill_random(pool, seed=8)
    tier = make_tier(redis_server.url, view, layout, ttl_s=0.3)
    writer = make_tier(redis_server.url, writer_view, layout, ttl_s=0.3)
    try:
        keys = keys_for(2, salt=80)
        assert run_job(tier, True, keys[:1], [0]).success  # stored here: a hit
        assert run_job(writer, True, keys[1:], [1]).success  # another engine's block
        lookup_all(tier, keys[1:])  # learned from PTTL (a hit, unless it expired already)
        rkeys = [remote_key_prefix(layout) + key for key in keys]
        with redis_server.client() as c:
            wait_until(lambda: not any(c.exists(k) for k in rkeys), "the server's expiry")
        assert lookup_all(tier, keys) == [MISS, MISS]  # asked again, not believed forever
        assert run_job(tier, True, keys, [0, 1]).success
        with redis_server.client() as c:
            assert all(c.exists(k) for k in rkeys)  # written again, not skipped as held
    finally:
        tier.close()
        writer.close()


def test_answers_expire_at_the_remaining_ttl() -> None:
    """A PTTL answer is believed until the expiry it states, counted from when it was asked."""
    answers = RemoteAnswers(lookup_wait_s=1.0, miss_ttl_s=60.0, max_known=8)
    a, b, c, d = keys_for(4, salt=81)
    now = time.monotonic()
    answers.learned([a, b, c, d], [-1, 600_000, 1_000, -2], asked_at=now)
    assert [answers.answer(k) for k in (a, b, d)] == [HIT, HIT, MISS]
    assert answers.answer(c) is HIT and answers.hits[c] == pytest.approx(now + 1.0)
    answers.hits.pop(c)
    answers.learned([c], [1_000], asked_at=now - 5)  # already expired when applied
    assert answers.answer(c) is MISS
    answers.learned([b], [None], asked_at=now)  # an unknown answer changes nothing
    assert answers.answer(b) is HIT


def test_a_value_of_the_wrong_type_is_corrupt_and_deleted(
    two_tiers, redis_server: RedisServer
) -> None:
    """Issue 18, defect 8: a key holding a hash (``WRONGTYPE`` on GET) is damage: counted as
    corrupt and deleted, as garbage bytes are (before: an I/O failure, left on the server)."""
    (a, b), (pool_a, pool_b) = two_tiers
    fill_random(pool_a, seed=13)
    keys = keys_for(2, salt=13)
    assert run_job(a, True, keys, [0, 1]).success
    rkey = remote_key_prefix(a.layout) + keys[0]
    with redis_server.client() as c:
        c.delete(rkey)
        c.hset(rkey, "field", "value")
    assert lookup_all(b, keys) == [HIT, HIT]
    result = run_job(b, False, keys, [2, 3])
    assert result.failed_keys == {keys[0]: "corrupt"}
    assert torch.equal(pool_b[3], pool_a[1])
    stats = b.stats()
    assert stats["failed_load_corrupt"] == 1 and stats["failed_load_io"] == 0
    with redis_server.client() as c:
        assert not c.exists(rkey)


def test_a_value_of_another_length_is_rejected_without_reading_past_it(
    two_tiers, redis_server: RedisServer
) -> None:
    """Values longer and shorter than the layout's block, pipelined between intact ones: each
    fails ``corrupt`` with its slot untouched (the long one never spills into the next slot or
    past the pool's end), the intact ones load exactly, the bad ones are deleted."""
    (a, b), (pool_a, pool_b) = two_tiers
    fill_random(pool_a, seed=14)
    keys = keys_for(4, salt=14)
    assert run_job(a, True, keys, [0, 1, 2, 3]).success
    prefix = remote_key_prefix(a.layout)
    with redis_server.client() as c:
        good = c.get(prefix + keys[1])
        c.set(prefix + keys[1], good + bytes(range(256)) * 64)  # 16 KiB too long
        c.set(prefix + keys[3], good[:-1])  # one byte short
    pool_b.fill_(0xEE)
    slots = [12, 13, 14, 15]  # keys[3] into the pool's last slot
    result = run_job(b, False, keys, slots)
    assert result.failed_keys == {keys[1]: "corrupt", keys[3]: "corrupt"}
    assert torch.equal(pool_b[12], pool_a[0]) and torch.equal(pool_b[14], pool_a[2])
    assert bool((pool_b[13] == 0xEE).all()) and bool((pool_b[15] == 0xEE).all())
    assert bool((pool_b[:12] == 0xEE).all())
    with redis_server.client() as c:
        assert not c.exists(prefix + keys[1]) and not c.exists(prefix + keys[3])


def test_close_reports_every_job_and_fails_later_ones(redis_server: RedisServer) -> None:
    _tensor, view = make_pool(8)
    tier = make_tier(redis_server.url, view, make_layout())
    keys = keys_for(8, salt=11)
    for i in range(4):
        tier.submit_store(job(keys[2 * i : 2 * i + 2], [2 * i, 2 * i + 1]))
    tier.drain_jobs()
    tier.close()
    tier.close()  # idempotent
    late = job(keys[:1], [0])
    tier.submit_load(late)
    results = tier.get_finished_jobs()
    assert len(results) == 5 and results[-1].failed_keys == {keys[0]: "io"}
    assert all(r.success for r in results[:4])


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="kv_remote_ttl_s"):
        RemoteTierConfig(url="redis://h", ttl_s=0)
    with pytest.raises(ConfigError, match="kv_remote_timeout"):
        RemoteTierConfig(url="redis://h", timeout_s=float("nan"))
    _, view = make_pool(2)
    with pytest.raises(ValueError, match="rows"):
        RedisTier(view, make_layout(block_bytes=8), RemoteTierConfig(url="redis://h"))


def test_an_unexpected_error_fails_the_job_and_the_tier_goes_on(two_tiers) -> None:
    (a, _), (pool_a, _) = two_tiers
    fill_random(pool_a, seed=12)
    keys = keys_for(2, salt=12)
    assert run_job(a, True, keys, [0, 1]).success
    bad = run_job(a, False, keys[:1], [pool_a.shape[0] + 3])  # a slot past the pool
    assert bad.failed_keys == {keys[0]: "io"}
    assert run_job(a, False, keys, [2, 3]).success
    assert torch.equal(pool_a[2:4], pool_a[0:2])


def test_every_result_notifies_the_result_signal(two_tiers) -> None:
    """A job's result notifies the signal the tier was given (from the job thread, and at once
    for a job with nothing to do), so the tiering manager's wait never misses one."""
    (a, _), _ = two_tiers
    signal = ResultSignal()
    a.set_result_signal(signal)
    a.submit_store(job(keys_for(2, salt=7), [0, 1]))
    assert signal.wait_past(0, 60)  # the store's result is ready (no timing: a 60 s bound)
    a.submit_load(job([], []))  # nothing to read: reported at once
    assert signal.count == 2
    assert sorted(r.success for r in wait_jobs(a, 2)) == [True, True]
