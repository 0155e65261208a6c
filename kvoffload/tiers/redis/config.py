"""Settings of the remote tier, and where its blocks live on the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvoffload.errors import ConfigError
from kvoffload.tiers.codec import check_compression
from kvoffload.tiers.contract import KVLayout
from kvoffload.tiers.redis.url import redacted_url

__all__ = ["VALUE_ALIGN", "RemoteTierConfig", "remote_key_prefix"]

#: Values are padded to 8 bytes, not to disk pages.
VALUE_ALIGN = 8


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """Settings of :class:`~kvoffload.tiers.redis.tier.RedisTier` (``url`` is ``kv_remote_url``;
    see :mod:`~kvoffload.tiers.redis.url` for its forms). ``repr`` hides the password."""

    url: str
    #: Bound of every network call (connect, send, receive), seconds.
    timeout_s: float = 1.0
    #: Server-side expiry of stored blocks (``SET ... PX``); ``None`` keeps them until evicted.
    ttl_s: float | None = None
    #: A key the lookup thread has not answered after this long is a MISS for now.
    lookup_wait_s: float = 0.25
    #: Once per engine step (:meth:`RedisTier.wait_for_answers`), the scheduler thread waits up
    #: to this long for the answers to the step's questions, so that a hit is promoted in the
    #: step that found it instead of the next one; 0: never wait.
    answer_wait_s: float = 0.01
    #: A remote MISS is believed this long before the server is asked again.
    miss_ttl_s: float = 2.0
    #: Bytes of values per pipelined window on one connection.
    pipeline_bytes: int = 16 << 20
    #: Connections per server (per master in a Cluster) a batch is spread over.
    connections: int = 4
    #: How often the server's memory figures are refreshed, seconds.
    stats_interval_s: float = 1.0
    #: The reconnect backoff doubles from 50 ms up to this, seconds.
    max_backoff_s: float = 5.0
    #: Most answers (hits and misses each) remembered locally; the oldest are forgotten first.
    max_known_keys: int = 1 << 20
    #: The caller runs on without the tier when the server cannot be used at start (errors
    #: then leave out the advice to set ``kv_remote_optional``).
    optional: bool = False
    #: ``kv_remote_compression``: ``none`` (values are the slots' bytes), ``lossless``,
    #: ``auto`` (lossless when the codec beats the link) or ``fp8`` (lossy, its own keys);
    #: see :mod:`kvoffload.tiers.codec`.
    compression: str = "none"

    def __repr__(self) -> str:
        """The settings, the URL shown without anything that may be a password."""
        shown = ", ".join(
            f"{f.name}={redacted_url(self.url) if f.name == 'url' else getattr(self, f.name)!r}"
            for f in fields(self)
        )
        return f"RemoteTierConfig({shown})"

    def __post_init__(self) -> None:
        positive = {
            "kv_remote_timeout": self.timeout_s,
            "kv_remote_lookup_wait_s": self.lookup_wait_s,
            "kv_remote_miss_ttl": self.miss_ttl_s,
            "kv_remote_stats_interval": self.stats_interval_s,
            "kv_remote_max_backoff": self.max_backoff_s,
        }
        if self.ttl_s is not None:
            positive["kv_remote_ttl_s"] = self.ttl_s
        for name, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")
        check_compression("kv_remote_compression", self.compression)
        wait = self.answer_wait_s
        if not (isinstance(wait, int | float) and math.isfinite(wait) and wait >= 0):
            raise ConfigError(
                "kv_remote_answer_wait_s", f"must be a number of seconds >= 0, got {wait!r}"
            )
        for name, value in (
            ("kv_remote_pipeline_bytes", self.pipeline_bytes),
            ("kv_remote_connections", self.connections),
            ("kv_remote_max_known_keys", self.max_known_keys),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")


def remote_key_prefix(layout: KVLayout, namespace: str = "") -> bytes:
    """The prefix of every Redis key this layout's blocks are stored under (in ``namespace``,
    the URL's ``namespace`` option, when not empty)."""
    space = namespace.encode() + b":" if namespace else b""
    return b"kvo:" + space + layout.fingerprint().hex().encode() + b":"
