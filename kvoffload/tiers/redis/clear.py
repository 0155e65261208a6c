"""Removing one layout's blocks (one model's fingerprint namespace) from a Redis / Valkey server.

An operator's ``clear`` of the remote tier: ``SCAN`` for ``PREFIX*`` on every master, then
``UNLINK`` what it finds (pipelined, one key per command so Cluster slots never mix). Only keys
under the prefix are touched (``kvo:[NAMESPACE:]FINGERPRINT:``, see
:func:`~kvoffload.tiers.redis.config.remote_key_prefix`), so other models' and other namespaces'
blocks stay. Returns the block keys removed (without the prefix), for the removal events.
"""

from __future__ import annotations

from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.unlink import unlink_matching
from kvoffload.tiers.redis.url import parse_redis_url

__all__ = ["drop_prefix"]


def drop_prefix(url: str, prefix: bytes, timeout_s: float = 5.0) -> list[bytes]:
    """Remove every key of the server(s) ``url`` names that starts with ``prefix`` (which must
    be a whole ``kvo:...:`` layout prefix); return the removed keys with ``prefix`` cut off.

    ``OSError`` (unreachable, timed out) and refusals are the caller's to report; keys removed
    before a failure stay removed.
    """
    if not prefix.startswith(b"kvo:") or not prefix.endswith(b":") or len(prefix) < 8:
        raise ConfigError("model", f"not a block-key prefix: {prefix!r}")
    pattern = _glob_escape(prefix) + b"*"
    removed = unlink_matching(parse_redis_url(url), pattern, timeout_s)
    return [key[len(prefix):] for key in removed]


def _glob_escape(raw: bytes) -> bytes:
    """``raw`` with Redis glob characters escaped (a namespace may hold none, but be safe)."""
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)
