"""Removing the keys that match a ``SCAN`` pattern from a Redis / Valkey server or Cluster:
``SCAN`` on every master, then ``UNLINK`` what it finds (freed in the server's background),
pipelined, one key per command so that Cluster slots never mix."""

from __future__ import annotations

from kvoffload.tiers.redis.connection import RedisConnection, RespError, encode_command
from kvoffload.tiers.redis.transport import RedisTransport
from kvoffload.tiers.redis.url import RedisURL

__all__ = ["unlink_matching"]

#: Keys asked for per ``SCAN`` call, and removed per pipelined batch of ``UNLINK``.
_SCAN_COUNT = 1000
#: ``SCAN`` calls per master at most: bounds the loop on a server whose keyspace keeps moving.
_MAX_SCANS = 100_000


def unlink_matching(url: RedisURL, pattern: bytes, timeout_s: float) -> list[bytes]:
    """Remove every key of the server(s) ``url`` names that matches ``pattern`` (a ``SCAN``
    ``MATCH`` glob); return the keys removed.

    ``OSError`` (unreachable, timed out) and refusals are the caller's to report; keys removed
    before a failure stay removed.
    """
    transport = RedisTransport(url, timeout_s, connections=1)
    try:
        transport.start()
        removed: list[bytes] = []
        for address in transport.nodes():
            removed += _unlink_on(transport.connect(address), pattern)
        return removed
    finally:
        transport.close()


def _unlink_on(conn: RedisConnection, pattern: bytes) -> list[bytes]:
    """``SCAN`` one server for ``pattern`` and ``UNLINK`` what it finds; the keys removed (those
    whose ``UNLINK`` answered 1). Closes ``conn``."""
    removed: list[bytes] = []
    cursor = b"0"
    try:
        for _ in range(_MAX_SCANS):
            cursor, keys = conn.call("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
            if keys:
                conn.begin()
                conn.send([b"".join(encode_command("UNLINK", key) for key in keys)])
                replies = [conn.read_reply() for _ in keys]
                removed += [k for k, r in zip(keys, replies, strict=True)
                            if r == 1 and not isinstance(r, RespError)]
            if cursor == b"0":
                break
    finally:
        conn.close()
    return removed
