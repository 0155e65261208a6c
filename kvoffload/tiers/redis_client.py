"""The redis-py client of the remote tier: connection setup, zero-copy values, error causes.

Client choice: redis-py with the hiredis reply parser (``benchmarks/remote_bandwidth.py
--clients`` measures redis-py, valkey-py and valkey-glide side by side; see
``docs/remote-tier.md``). redis-py speaks to Redis and Valkey servers alike, groups a Cluster
pipeline's commands per shard node, and follows MOVED redirections and failovers itself.

Zero-copy stores: a value is the block header followed by the host slot's bytes. On plain TCP the
connection packs a :class:`FramedValue` as one RESP bulk string sent in pieces: the header, then
the slot's ``memoryview`` straight from the host pool to the socket (no join, no copy). TLS
connections use redis-py's own connection and serializer (the value is joined once).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from kvoffload.tiers.redis_url import RedisURL

__all__ = ["FramedValue", "RemoteClient", "ZeroCopyConnection", "close_client", "connect", "error_cause"]

RemoteClient = redis.Redis | RedisCluster


class FramedValue:
    """A SET value made of a small header and a large payload that are never joined."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + self.payload.nbytes


class _FramedSerializer(PythonRespSerializer):
    """redis-py's pure-Python RESP serializer, plus :class:`FramedValue` arguments."""

    def pack(self, *args: Any) -> list[Any]:
        if not any(type(arg) is FramedValue for arg in args):
            return super().pack(*args)
        out: list[Any] = []
        buf = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is FramedValue:
                out.append(b"%s$%d\r\n%s" % (buf, len(arg), arg.header))
                out.append(arg.payload)  # a memoryview: sent as is by pack_commands/sendall
                buf = b"\r\n"
            else:
                data = self.encode(arg)
                buf = b"%s$%d\r\n%s\r\n" % (buf, len(data), data)
        out.append(buf)
        return out


class ZeroCopyConnection(redis.Connection):
    """A plain-TCP connection that sends :class:`FramedValue` payloads without copying them."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or _FramedSerializer(self._buffer_cutoff, self.encoder.encode)


def connect(url: RedisURL, timeout_s: float) -> tuple[RemoteClient, bool]:
    """A client of ``url`` whose every network call gives up after ``timeout_s`` seconds, and
    whether it takes :class:`FramedValue` values. Retries are few and short: the tier does its
    own reconnect backoff. A Cluster client contacts its seed nodes here (errors propagate)."""
    common: dict[str, Any] = {
        "username": url.username,
        "password": url.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "client_name": "kvoffload",
    }
    zero_copy = not url.tls
    if url.tls:
        common["ssl"] = True
        common.update(dict(url.tls_options))
    else:
        common["connection_class"] = ZeroCopyConnection
    if url.cluster:
        (host, port), *others = url.nodes
        client: RemoteClient = RedisCluster(
            # The first seed as a URL: redis-py then builds the node clients through connection
            # pools, the only way it passes connection_class on to the nodes' connections.
            url=f"redis://{_bracket(host)}:{port}/0" if not url.tls else None,
            startup_nodes=[ClusterNode(h, p) for h, p in (others if not url.tls else url.nodes)],
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
            **common,
        )
    else:
        host, port = url.nodes[0]
        options = {"host": host, "port": port, "db": url.db, "retry": Retry(NoBackoff(), 0)}
        if url.tls:
            client = redis.Redis(**options, **common)
        else:  # redis.Redis takes a connection class only through a pool
            client = redis.Redis(connection_pool=redis.ConnectionPool(**options, **common))
    return client, zero_copy


def close_client(client: RemoteClient) -> None:
    """Close ``client`` and every connection it opened (a pool passed to ``redis.Redis`` is
    not closed by ``Redis.close``)."""
    client.close()
    if isinstance(client, redis.Redis):
        client.connection_pool.disconnect()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def error_cause(exc: BaseException) -> str:
    """The :class:`~kvoffload.tiers.base.TierJobResult` cause of a client error."""
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "full"
    return "io"
