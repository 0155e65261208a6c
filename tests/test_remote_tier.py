"""The remote tier against a real standalone ``redis-server``: round trips between two tiers,
asynchronous lookups, verified loads (garbage, truncation, foreign layouts, vanished values),
server-side eviction and expiry, credentials, and a server that dies and comes back."""

from __future__ import annotations

import logging
import threading

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_servers import RedisServer, TLSRedisServer, make_certificates, standalone_server
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
from kvoffload.base import LookupResult
from kvoffload.errors import ConfigError
from kvoffload.tiers.blockformat import encode_header, payload_checksum
from kvoffload.tiers.redis_client import ZeroCopyConnection
from kvoffload.tiers.remote import VALUE_ALIGN, RedisTier, RemoteTierConfig, remote_key_prefix

HIT, MISS, RETRY, PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)


@pytest.fixture
def two_tiers(redis_server: RedisServer):  # type: ignore[no-untyped-def]
    """Two tiers (two "engines") of one layout on one server, with 16-slot pools."""
    layout = make_layout()
    pools = [make_pool(16), make_pool(16)]
    tiers = [make_tier(redis_server.url, view, layout) for _, view in pools]
    yield tiers, [tensor for tensor, _ in pools]
    for tier in tiers:
        tier.close()


def test_blocks_stored_by_one_tier_load_in_another(two_tiers) -> None:  # type: ignore[no-untyped-def]
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


def test_unknown_keys_are_misses_and_asked_once(two_tiers) -> None:  # type: ignore[no-untyped-def]
    (a, _), _ = two_tiers
    keys = keys_for(50, salt=1)
    ctx = ReqContext("r")
    assert {a.lookup(key, ctx) for key in keys} == {RETRY}
    assert lookup_all(a, keys) == [MISS] * 50
    stats = a.stats()
    assert stats["lookups_sent"] == 50  # every key asked exactly once
    assert stats["lookup_round_trips"] >= 1 and stats["lookup_round_trip_us"] > 0  # timed
    assert a.lookup(keys[0], ctx) is MISS  # the remote miss is believed for miss_ttl_s


def test_store_is_pending_until_written_and_repeats_are_skipped(two_tiers) -> None:  # type: ignore[no-untyped-def]
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


def _corrupt_values(server: RedisServer, prefix: bytes, keys: list[bytes], block: int) -> None:
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


def test_bad_values_fail_their_loads_with_a_cause(two_tiers, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
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
    assert not pool_b[:4].any()  # failed loads never touch their slots
    stats = b.stats()
    assert stats["failed_load_corrupt"] == 2 and stats["failed_load_layout"] == 1
    assert stats["failed_load_checksum"] == 1 and stats["failed_load_blocks"] == 4
    (event,) = b.take_events()
    assert event.removed and set(event.keys) == set(keys[:4])
    assert b.lookup(keys[0], ReqContext("r")) is RETRY  # forgotten, asked again
    assert lookup_all(b, keys[:4]) == [MISS] * 4  # and deleted from the server


def test_a_value_that_vanished_is_a_missing_load(two_tiers, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    (a, _), (pool_a, _) = two_tiers
    fill_random(pool_a, seed=6)
    keys = keys_for(3, salt=4)
    assert run_job(a, True, keys, [0, 1, 2]).success
    with redis_server.client() as c:
        c.delete(remote_key_prefix(a.layout) + keys[1])
    result = run_job(a, False, keys, [3, 4, 5])
    assert result.failed_keys == {keys[1]: "missing"}
    assert a.stats()["vanished_blocks"] == 1


def test_layouts_are_namespaced(two_tiers, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    (a, _), (_pool_a, _) = two_tiers
    keys = keys_for(2, salt=5)
    assert run_job(a, True, keys, [0, 1]).success
    _, view = make_pool(4)
    other = make_tier(redis_server.url, view, make_layout())
    try:
        assert lookup_all(other, keys) == [MISS, MISS]
    finally:
        other.close()


def test_zero_copy_connection_is_used(two_tiers) -> None:  # type: ignore[no-untyped-def]
    (a, _), _ = two_tiers
    assert a._client.connection_pool.connection_class is ZeroCopyConnection


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


def test_ttl_expires_blocks_on_the_server(redis_server: RedisServer) -> None:
    _tensor, view = make_pool(2)
    layout = make_layout()
    tier = make_tier(redis_server.url, view, layout, ttl_s=0.2)
    try:
        keys = keys_for(2, salt=8)
        assert run_job(tier, True, keys, [0, 1]).success
        with redis_server.client() as c:
            assert 0 < c.pttl(remote_key_prefix(layout) + keys[0]) <= 200
            wait_until(lambda: not c.exists(remote_key_prefix(layout) + keys[0]), "expiry")
        assert run_job(tier, False, keys, [0, 1]).failed_keys.keys() == set(keys)
    finally:
        tier.close()


PASSWORD = "s3cr3t-Pa55"


def test_password_from_url_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with standalone_server(password=PASSWORD) as server:
        _, view = make_pool(2)
        layout = make_layout()
        tier = make_tier(server.url, view, layout)
        assert PASSWORD not in repr(tier) and "***" in repr(tier)
        tier.close()
        monkeypatch.setenv("KVOFFLOAD_REMOTE_PASSWORD", PASSWORD)
        tier = make_tier(f"redis://127.0.0.1:{server.port}", view, layout)
        assert run_job(tier, True, keys_for(1), [0]).success
        tier.close()


def test_wrong_password_is_a_clear_error_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with standalone_server(password=PASSWORD) as server:
        _, view = make_pool(2)
        wrong = "wrong-" + PASSWORD
        with pytest.raises(ConfigError) as info:
            make_tier(f"redis://:{wrong}@127.0.0.1:{server.port}/0", view, make_layout())
        message = str(info.value)
        assert info.value.field == "kv_remote_url" and "credentials" in message
        assert wrong not in message and PASSWORD not in message
        with pytest.raises(ConfigError) as info:
            make_tier(f"redis://127.0.0.1:{server.port}/0", view, make_layout())  # none given
        assert info.value.field == "kv_remote_url"
        assert wrong not in caplog.text and PASSWORD not in caplog.text


def test_tls_with_the_ca_in_the_url(tls_redis: TLSRedisServer) -> None:
    """rediss:// with ``ssl_ca_certs``: one tier's blocks load in another, over TLS only (the
    server has no plain port)."""
    layout = make_layout()
    (pool_a, view_a), (pool_b, view_b) = make_pool(4), make_pool(4)
    a, b = make_tier(tls_redis.url, view_a, layout), make_tier(tls_redis.url, view_b, layout)
    try:
        assert not a._zero_copy  # TLS goes through redis-py's own SSL connection
        fill_random(pool_a)
        keys = keys_for(4)
        assert run_job(a, True, keys, [0, 1, 2, 3]).success
        assert lookup_all(b, keys) == [HIT] * 4
        assert run_job(b, False, keys, [3, 2, 1, 0]).success
        assert torch.equal(pool_b, pool_a.flip(0))
    finally:
        a.close()
        b.close()
    with tls_redis.client() as c:
        assert c.info("server")["tcp_port"] == tls_redis.port  # --tls-port; --port 0


def test_tls_without_the_right_ca_is_a_clear_error(tls_redis: TLSRedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """No CA (the system's do not know the test CA), another CA, a CA file that does not exist,
    or plain TCP to the TLS port: a ConfigError naming kv_remote_url, and for the CA cases
    ``ssl_ca_certs``, how to pass it."""
    _, view = make_pool(2)
    bare = f"rediss://127.0.0.1:{tls_redis.port}/0"
    other_ca, _, _ = make_certificates(tmp_path, "other")
    for url, trusted in (
        (bare, "the system's CAs (no ssl_ca_certs given)"),
        (f"{bare}?ssl_ca_certs={other_ca}", f"ssl_ca_certs={other_ca}"),
    ):
        with pytest.raises(ConfigError) as info:
            make_tier(url, view, make_layout(), timeout_s=5)
        message = str(info.value)
        assert info.value.field == "kv_remote_url"
        assert f"TLS certificate did not verify against {trusted}" in message, message
        assert "?ssl_ca_certs=/path/to/ca.pem" in message
    missing = tmp_path / "missing-ca.pem"
    with pytest.raises(
        ConfigError, match=rf"kv_remote_url: ssl_ca_certs='{missing}' .*no such file"
    ):
        make_tier(f"{bare}?ssl_ca_certs={missing}", view, make_layout())
    with pytest.raises(ConfigError, match="kv_remote_url: cannot reach redis://"):
        make_tier(f"redis://127.0.0.1:{tls_redis.port}/0", view, make_layout(), timeout_s=5)


def test_server_down_at_start_names_the_setting() -> None:
    with standalone_server() as server:
        url = server.url
    _, view = make_pool(2)
    with pytest.raises(ConfigError, match=r"kv_remote_url: cannot reach redis://127\.0\.0\.1"):
        make_tier(url, view, make_layout(), timeout_s=0.5)


def test_connection_lost_fails_jobs_then_reconnects(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from redis_servers import free_port

    server = RedisServer(free_port(), tmp_path / "r")
    server.start()
    tensor, view = make_pool(8)
    fill_random(tensor, seed=9)
    tier = make_tier(server.url, view, make_layout(), timeout_s=0.5, lookup_wait_s=0.5)
    try:
        keys = keys_for(8, salt=9)
        assert run_job(tier, True, keys[:4], [0, 1, 2, 3]).success
        server.kill()
        load = run_job(tier, False, keys[:2], [4, 5])
        assert set(load.failed_keys.values()) == {"io"}  # recompute
        store = run_job(tier, True, keys[4:], [4, 5, 6, 7])
        assert set(store.failed_keys.values()) == {"io"}  # dropped
        stats = tier.stats()
        assert stats["dropped_store_blocks"] == 4 and stats["connection_errors"] >= 1
        assert lookup_all(tier, keys[6:7]) == [MISS]  # while down: no waiting on the network
        server.start()  # same port, empty server

        def stores_again() -> bool:
            return run_job(tier, True, keys[4:5], [4]).success

        wait_until(stores_again, "the tier to reconnect")
        assert tier.stats()["reconnects"] >= 1
        assert lookup_all(tier, keys[4:5]) == [HIT]
    finally:
        tier.close()
        server.stop()


def test_slow_server_times_out_and_recovers(redis_server: RedisServer) -> None:
    tensor, view = make_pool(4)
    fill_random(tensor, seed=10)
    tier = make_tier(redis_server.url, view, make_layout(), timeout_s=0.2)
    try:
        keys = keys_for(4, salt=10)
        assert run_job(tier, True, keys[:2], [0, 1]).success
        sleeper = threading.Thread(target=_debug_sleep, args=(redis_server, 3))
        sleeper.start()
        wait_until(lambda: _server_is_busy(redis_server), "DEBUG SLEEP to start")
        result = run_job(tier, True, keys[2:], [2, 3])
        sleeper.join()
        assert set(result.failed_keys.values()) == {"timeout"}  # dropped after 0.2 s, not 3 s
        assert tier.stats()["failed_store_timeout"] == 2

        def loads_again() -> bool:
            return run_job(tier, False, keys[:2], [2, 3]).success

        wait_until(loads_again, "loads to succeed after the sleep")
        assert torch.equal(tensor[2:4], tensor[0:2])
    finally:
        tier.close()


def _debug_sleep(server: RedisServer, seconds: int) -> None:
    with server.client() as c:
        c.execute_command("DEBUG", "SLEEP", str(seconds))


def _server_is_busy(server: RedisServer) -> bool:
    try:
        with redis.Redis(
            host="127.0.0.1", port=server.port, socket_timeout=0.05, retry=Retry(NoBackoff(), 0)
        ) as c:
            c.ping()
    except redis.TimeoutError:
        return True
    return False


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


def test_an_unexpected_error_fails_the_job_and_the_tier_goes_on(two_tiers) -> None:  # type: ignore[no-untyped-def]
    (a, _), (pool_a, _) = two_tiers
    fill_random(pool_a, seed=12)
    keys = keys_for(2, salt=12)
    assert run_job(a, True, keys, [0, 1]).success
    bad = run_job(a, False, keys[:1], [pool_a.shape[0] + 3])  # a slot past the pool
    assert bad.failed_keys == {keys[0]: "io"}
    assert run_job(a, False, keys, [2, 3]).success
    assert torch.equal(pool_a[2:4], pool_a[0:2])
