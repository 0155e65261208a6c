"""Removing one namespace's blocks from a Redis / Valkey server or Cluster.

``bench throughput --compare`` runs each remote configuration in a fresh namespace of the
user's server (``?namespace=bench-...``) so that no run finds another's blocks; afterwards it
removes that namespace with :func:`drop_namespace`, so a benchmark leaves nothing behind on a
server it did not start. Only keys under ``kvo:NAMESPACE:`` are touched: ``SCAN`` with that
pattern on every master, then ``UNLINK`` (freed in the server's background), pipelined.
"""

from __future__ import annotations

from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.connection import RedisConnection, RespError, encode_command
from kvoffload.tiers.redis.transport import RedisTransport
from kvoffload.tiers.redis.url import parse_redis_url

__all__ = ["drop_namespace"]

#: Keys asked for per ``SCAN`` call, and removed per pipelined batch of ``UNLINK``.
_SCAN_COUNT = 1000
#: ``SCAN`` calls per master at most: bounds the loop on a server whose keyspace keeps moving.
_MAX_SCANS = 100_000


def drop_namespace(url: str, timeout_s: float = 5.0) -> int:
    """Remove every key of the namespace ``url`` names (its ``namespace`` option, which must be
    set: the keys of ``kvo:`` itself are never dropped); return how many were removed.

    ``OSError`` (unreachable, timed out) and ``RespErrorRaised`` (refused) are the caller's to
    report; keys removed before a failure stay removed.
    """
    parsed = parse_redis_url(url)
    if not parsed.namespace:
        raise ConfigError("kv_remote_url", "drop_namespace needs a URL with ?namespace=")
    pattern = b"kvo:" + parsed.namespace.encode() + b":*"
    transport = RedisTransport(parsed, timeout_s, connections=1)
    try:
        transport.start()
        return sum(_drop_on(transport.connect(address), pattern) for address in transport.nodes())
    finally:
        transport.close()


def _drop_on(conn: RedisConnection, pattern: bytes) -> int:
    """``SCAN`` one server for ``pattern`` and ``UNLINK`` what it finds (one key per command, so
    that Cluster slots never mix); the number removed."""
    removed = 0
    cursor = b"0"
    try:
        for _ in range(_MAX_SCANS):
            cursor, keys = conn.call("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
            if keys:
                conn.begin()
                conn.send([b"".join(encode_command("UNLINK", key) for key in keys)])
                replies = [conn.read_reply() for _ in keys]
                removed += sum(r for r in replies if not isinstance(r, RespError))
            if cursor == b"0":
                break
    finally:
        conn.close()
    return removed
