"""The remote tier when the network or the server misbehaves, against real ``redis-server``
processes: credentials, TLS, a server down at start, killed, stopped (never answering), values
trickling in tiny TCP segments or cut off mid-value by a proxy of ours; and the one-line messages
each of these gives."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from redis_servers import (
    RedisServer,
    TLSRedisServer,
    free_port,
    make_certificates,
    standalone_server,
)
from remote_cases import (
    fill_random,
    keys_for,
    lookup_all,
    make_layout,
    make_pool,
    make_tier,
    run_job,
    wait_until,
)
from remote_proxy import TrickleProxy

from kvoffload.errors import ConfigError
from kvoffload.manager_contract import LookupResult

HIT, MISS = LookupResult.HIT, LookupResult.MISS
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


def test_wrong_or_missing_password_is_one_clear_line(caplog: pytest.LogCaptureFixture) -> None:
    """Wrong: "refused the credentials". Missing: "requires a password and none was given"
    (before: Redis's own "HELLO must be called with the client already authenticated"). Given
    to a server without one: "has none configured". The password is never shown."""
    caplog.set_level(logging.DEBUG)
    _, view = make_pool(2)
    wrong = "wrong-" + PASSWORD
    with standalone_server(password=PASSWORD) as server:
        with pytest.raises(ConfigError) as info:
            make_tier(f"redis://:{wrong}@127.0.0.1:{server.port}/0", view, make_layout())
        message = str(info.value)
        assert info.value.field == "kv_remote_url" and "refused the credentials" in message
        assert wrong not in message and PASSWORD not in message and "\n" not in message
        with pytest.raises(ConfigError) as info:
            make_tier(f"redis://127.0.0.1:{server.port}/0", view, make_layout())
        message = str(info.value)
        assert "requires a password and none was given" in message, message
        assert "KVOFFLOAD_REMOTE_PASSWORD" in message and "HELLO" not in message
    with standalone_server() as server, pytest.raises(ConfigError) as info:
        make_tier(f"redis://:{wrong}@127.0.0.1:{server.port}/0", view, make_layout())
    assert "has none configured" in str(info.value) and wrong not in str(info.value)
    assert wrong not in caplog.text and PASSWORD not in caplog.text


def test_tls_with_the_ca_in_the_url(tls_redis: TLSRedisServer) -> None:
    """rediss:// with ``ssl_ca_certs``: one tier's blocks load in another, over TLS only (the
    server has no plain port)."""
    layout = make_layout()
    (pool_a, view_a), (pool_b, view_b) = make_pool(4), make_pool(4)
    a, b = make_tier(tls_redis.url, view_a, layout), make_tier(tls_redis.url, view_b, layout)
    try:
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


def test_tls_without_the_right_ca_is_a_clear_error(
    tls_redis: TLSRedisServer, tmp_path: Path
) -> None:
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
    """One line naming the setting; the advice to set kv_remote_optional only where it is not
    set already (before: also in the warning of a run with kv_remote_optional)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    _, view = make_pool(2)
    with pytest.raises(
        ConfigError, match=r"kv_remote_url: cannot reach redis://127\.0\.0\.1"
    ) as info:
        make_tier(url, view, make_layout(), timeout_s=0.5)
    assert "set kv_remote_optional" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_tier(url, view, make_layout(), timeout_s=0.5, optional=True)
    assert "kv_remote_optional" not in str(info.value)
    assert "start the server or fix the URL" in str(info.value)


def test_cluster_url_at_a_standalone_server_is_one_line(redis_server: RedisServer) -> None:
    """Before: a 90-line chained traceback (RedisClusterException)."""
    _, view = make_pool(2)
    with pytest.raises(ConfigError) as info:
        make_tier(f"redis+cluster://127.0.0.1:{redis_server.port}", view, make_layout())
    message = str(info.value)
    assert message.startswith("kv_remote_url: redis+cluster://127.0.0.1:")
    assert (
        "not in Cluster mode" in message
        and f"use redis://127.0.0.1:{redis_server.port}/0" in message
    )
    assert "\n" not in message and info.value.__cause__ is None


def test_connection_lost_fails_jobs_then_reconnects(tmp_path: Path) -> None:
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


def test_a_failed_lookup_is_no_answer(tmp_path: Path) -> None:
    """Issue 18, defect 5: a lookup round trip that failed is unknown, not a miss: once the
    server is back the key is asked again and found (before: a MISS for ``miss_ttl_s``)."""
    server = RedisServer(free_port(), tmp_path / "r")
    server.start()
    layout = make_layout()
    (pool, view), (_, writer_view) = make_pool(2), make_pool(2)
    tier = make_tier(server.url, view, layout, miss_ttl_s=3600, stats_interval_s=3600)
    try:
        key = keys_for(1, salt=16)
        server.kill()
        assert lookup_all(tier, key) == [MISS]  # the question failed: a miss for now
        assert tier.stats()["connection_errors"] >= 1
        server.start()  # same port, empty server
        writer = make_tier(server.url, writer_view, layout)
        fill_random(pool, seed=16)
        assert run_job(writer, True, key, [0]).success
        writer.close()
        wait_until(lambda: tier.stats()["connected"] == 1, "the reconnect backoff to pass")
        assert lookup_all(tier, key) == [HIT]
    finally:
        tier.close()
        server.stop()


def test_a_server_that_never_answers_times_out_and_recovers(redis_server: RedisServer) -> None:
    """The server stopped (SIGSTOP): the store's connection times out (``timeout``, after
    ``timeout_s``, however slow the machine: nothing ever answers); once resumed, loads work."""
    tensor, view = make_pool(4)
    fill_random(tensor, seed=10)
    tier = make_tier(redis_server.url, view, make_layout(), timeout_s=0.2, stats_interval_s=3600)
    try:
        keys = keys_for(4, salt=10)
        assert run_job(tier, True, keys[:2], [0, 1]).success
        with redis_server.paused():
            result = run_job(tier, True, keys[2:], [2, 3])
        assert set(result.failed_keys.values()) == {"timeout"}
        assert tier.stats()["failed_store_timeout"] == 2

        def loads_again() -> bool:
            return run_job(tier, False, keys[:2], [2, 3]).success

        wait_until(loads_again, "loads to succeed after the pause")
        assert torch.equal(tensor[2:4], tensor[0:2])
    finally:
        tier.close()


def test_values_received_in_many_small_segments_land_exactly(redis_server: RedisServer) -> None:
    """Every reply trickles through a proxy of ours in 1..61-byte TCP segments: the loads (and
    the lookups, and the handshake) parse lines and values cut anywhere, byte-exact."""
    layout = make_layout()
    (pool_a, view_a), (pool_b, view_b) = make_pool(8), make_pool(8)
    fill_random(pool_a, seed=17)
    proxy = TrickleProxy(redis_server.port, segment=61)
    writer = make_tier(redis_server.url, view_a, layout)
    reader = make_tier(proxy.url(), view_b, layout)
    try:
        keys = keys_for(4, salt=17)
        assert run_job(writer, True, keys, [0, 1, 2, 3]).success
        assert lookup_all(reader, [*keys, *keys_for(1, salt=18)]) == [HIT] * 4 + [MISS]
        assert run_job(reader, False, keys, [7, 6, 5, 4]).success
        assert torch.equal(pool_b[4:].flip(0), pool_a[:4])
    finally:
        writer.close()
        reader.close()
        proxy.close()


def test_a_connection_dropped_mid_value_fails_that_load_cleanly(redis_server: RedisServer) -> None:
    """The proxy cuts the connection in the middle of the second value: that load fails (``io``,
    nothing wrong reported as loaded), and the next load, on a new connection, is exact."""
    layout = make_layout()
    (pool_a, view_a), (pool_b, view_b) = make_pool(8), make_pool(8)
    fill_random(pool_a, seed=19)
    proxy = TrickleProxy(redis_server.port)
    writer = make_tier(redis_server.url, view_a, layout)
    reader = make_tier(proxy.url(), view_b, layout, stats_interval_s=3600)
    try:
        keys = keys_for(4, salt=19)
        assert run_job(writer, True, keys, [0, 1, 2, 3]).success
        assert view_a.strides is not None
        row = view_a.strides[0]  # one slot's bytes
        proxy.drop_after(row + row // 2)  # mid second value
        cut = run_job(reader, False, keys, [4, 5, 6, 7])
        assert cut.failed_keys and set(cut.failed_keys.values()) == {"io"}
        assert cut.num_bytes == (4 - len(cut.failed_keys)) * row
        pool_b.zero_()

        def loads_again() -> bool:
            return run_job(reader, False, keys, [4, 5, 6, 7]).success

        wait_until(loads_again, "a load after the cut")
        assert torch.equal(pool_b[4:], pool_a[:4])
        assert proxy.connections >= 2
    finally:
        writer.close()
        reader.close()
        proxy.close()


def test_connections_the_server_closed_while_idle_are_replaced() -> None:
    """A server that closes idle clients (``timeout 1``): after our pooled connections were
    closed, the next store and load open new ones and succeed (no batch lost to a stale
    connection, no backoff)."""
    with standalone_server(extra_args=("--timeout", "1")) as server:
        tensor, view = make_pool(4)
        fill_random(tensor, seed=20)
        tier = make_tier(server.url, view, make_layout(), stats_interval_s=3600)
        try:
            keys = keys_for(2, salt=20)
            assert run_job(tier, True, keys, [0, 1]).success
            with server.client() as c:

                def ours_closed() -> bool:
                    return not any(cl["name"] == "kvoffload" for cl in c.client_list())

                wait_until(ours_closed, "the server to close the idle connections")
            assert run_job(tier, False, keys, [2, 3]).success
            assert torch.equal(tensor[2:], tensor[:2])
            assert tier.stats()["connection_errors"] == 0
        finally:
            tier.close()
