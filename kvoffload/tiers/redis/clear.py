"""Removing one layout's blocks (one model's fingerprint namespace) from a Redis / Valkey server.

An operator's ``clear`` of the remote tier: ``SCAN`` for ``PREFIX*`` on every master, then
``UNLINK`` what it finds (pipelined, one key per command so Cluster slots never mix). Only keys
under the prefix are touched (``kvo:[NAMESPACE:]FINGERPRINT:``, see
:func:`~kvoffload.tiers.redis.config.remote_key_prefix`), so other models' and other namespaces'
blocks stay. Returns the block keys removed (without the prefix), for the removal events.
"""

from __future__ import annotations

from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.connection import RedisConnection, RespError, encode_command
from kvoffload.tiers.redis.transport import RedisTransport
from kvoffload.tiers.redis.url import parse_redis_url

__all__ = ["drop_prefix"]

_SCAN_COUNT = 1000
_MAX_SCANS = 100_000  # per master: bounds the loop on a keyspace that keeps moving


def drop_prefix(url: str, prefix: bytes, timeout_s: float = 5.0) -> list[bytes]:
    """Remove every key of the server(s) ``url`` names that starts with ``prefix`` (which must
    be a whole ``kvo:...:`` layout prefix); return the removed keys with ``prefix`` cut off.

    ``OSError`` (unreachable, timed out) and refusals are the caller's to report; keys removed
    before a failure stay removed.
    """
    if not prefix.startswith(b"kvo:") or not prefix.endswith(b":") or len(prefix) < 8:
        raise ConfigError("model", f"not a block-key prefix: {prefix!r}")
    pattern = _glob_escape(prefix) + b"*"
    transport = RedisTransport(parse_redis_url(url), timeout_s, connections=1)
    try:
        transport.start()
        removed: list[bytes] = []
        for address in transport.nodes():
            removed += _drop_on(transport.connect(address), pattern)
        return [key[len(prefix):] for key in removed]
    finally:
        transport.close()


def _glob_escape(raw: bytes) -> bytes:
    """``raw`` with Redis glob characters escaped (a namespace may hold none, but be safe)."""
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _drop_on(conn: RedisConnection, pattern: bytes) -> list[bytes]:
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
