"""The remote tier's timeout bounds an operation, not each ``recv`` (issue 29): a server whose
reply trickles in a byte at a time, each byte well within ``timeout_s`` of the last, still
gives up at ``timeout_s``. A real ``redis-server``, a proxy of ours on loopback; the proxy
pauses 20 ms per byte, so the reply needs at least 300 x 20 ms = 6 s, six times the 1 s
timeout: the outcome does not depend on the machine's speed."""

from __future__ import annotations

import pytest
from redis_servers import RedisServer
from remote_cases import fill_random, keys_for, make_layout, make_pool, make_tier, run_job
from remote_proxy import TrickleProxy

from kvoffload.tiers.redis.connection import RedisConnection

_TIMEOUT_S = 1.0


def trickle(proxy: TrickleProxy) -> None:
    """From now on, one byte of the server's replies every 20 ms."""
    proxy.segment, proxy.pause_s = 1, 0.02


def test_a_trickled_reply_times_out_at_the_operations_deadline(
    redis_server: RedisServer,
) -> None:
    value = bytes(range(256)) + bytes(44)  # 300 bytes
    direct = RedisConnection("127.0.0.1", redis_server.port, 5.0)
    proxy = TrickleProxy(redis_server.port)
    try:
        direct.call("SET", b"kvoffload-test:trickle", value)
        slow = RedisConnection("127.0.0.1", proxy.port, _TIMEOUT_S)  # handshake at full speed
        try:
            assert slow.call("GET", b"kvoffload-test:trickle") == value
            trickle(proxy)
            with pytest.raises(TimeoutError):
                slow.call("GET", b"kvoffload-test:trickle")
            assert slow.broken
        finally:
            slow.close()
    finally:
        direct.call("DEL", b"kvoffload-test:trickle")
        direct.close()
        proxy.close()


def test_a_load_from_a_trickling_server_fails_as_timeout(redis_server: RedisServer) -> None:
    """The tier's load of one block through the trickling proxy fails ``timeout``."""
    layout = make_layout()
    (pool_a, view_a), (_, view_b) = make_pool(2), make_pool(2)
    fill_random(pool_a, seed=29)
    proxy = TrickleProxy(redis_server.port)
    writer = make_tier(redis_server.url, view_a, layout)
    reader = make_tier(proxy.url(), view_b, layout, timeout_s=_TIMEOUT_S, stats_interval_s=3600)
    try:
        keys = keys_for(1, salt=29)
        assert run_job(writer, True, keys, [0]).success
        assert run_job(reader, False, keys, [1]).success  # connected at full speed
        trickle(proxy)
        result = run_job(reader, False, keys, [0])
        assert result.failed_keys == {keys[0]: "timeout"}
    finally:
        writer.close()
        reader.close()
        proxy.close()
