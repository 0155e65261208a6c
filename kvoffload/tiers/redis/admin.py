"""Removing one namespace's blocks from a Redis / Valkey server or Cluster.

``bench throughput --compare`` runs each remote configuration in a fresh namespace of the
user's server (``?namespace=bench-...``) so that no run finds another's blocks; afterwards it
removes that namespace with :func:`drop_namespace`, so a benchmark leaves nothing behind on a
server it did not start. Only keys under ``kvo:NAMESPACE:`` are touched: ``SCAN`` with that
pattern on every master, then ``UNLINK`` (freed in the server's background), pipelined.
"""

from __future__ import annotations

from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.unlink import unlink_matching
from kvoffload.tiers.redis.url import parse_redis_url

__all__ = ["drop_namespace"]


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
    return len(unlink_matching(parsed, pattern, timeout_s))
