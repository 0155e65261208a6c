"""The remote tier's transport: pipelined commands over pooled connections, fanned out over
connections and Cluster shards, with the server's health.

:class:`RedisTransport` sits under :class:`~kvoffload.tiers.redis.tier.RedisTier` as httpx's transport
sits under its client: the tier decides what to ask (which keys, which values, what a reply
means for a block); the transport moves commands and replies and knows nothing of blocks.

* **Operations**, each for a list of keys, one result per key: :meth:`RedisTransport.get_into`
  (values received straight into caller buffers, see
  :meth:`~kvoffload.tiers.redis.connection.RedisConnection.read_value_into`),
  :meth:`RedisTransport.set_values`, :meth:`RedisTransport.ttls` (``PTTL``),
  :meth:`RedisTransport.delete`, plus :meth:`RedisTransport.server_figures` (``INFO``). A result
  is the reply, a :class:`~kvoffload.tiers.redis.connection.RespError` for an error reply, or the
  ``OSError`` that failed the key's connection (``TimeoutError`` on a timeout).
* **Fan-out**: the keys are grouped by node (one group standalone; per slot master in a
  Cluster), each group is cut into up to ``connections`` parts, and the parts run at the same
  time on pooled connections (the calling thread runs one part, a thread pool the others: their
  threads release the GIL in ``recv_into`` / ``sendmsg`` and while hashing). A part is
  pipelined in windows of ``pipeline_bytes``: the next window's commands are sent before the
  current window's replies are read. A part that fails (a timeout, a broken connection) fails
  only its own keys.
* **Health**: a failed connection marks the server down for a backoff that doubles from 50 ms
  up to ``max_backoff_s``; while down every operation fails at once without touching the
  network (the result is :data:`DOWN`). The first success after a failure counts a reconnect.
  In a Cluster, a failed connection or a ``MOVED`` / ``ASK`` / ``CLUSTERDOWN`` reply re-reads the
  slot map (following a failover or resharding).

Connections are opened lazily, one per part at most, and kept in a per-node pool; a connection
that failed is closed, never reused.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvoffload.tiers.redis.connection import (
    RedisConnection,
    RespError,
    encode_command,
    tls_context,
)
from kvoffload.tiers.redis.topology import Address, SlotMap
from kvoffload.tiers.redis.url import RedisURL

__all__ = ["DOWN", "RedisTransport"]

log = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.05
#: The result of a command not sent because the server is marked down.
DOWN = ConnectionError("the remote server is marked down (reconnect backoff)")
#: Error replies after which a Cluster's slot map is re-read.
_REROUTE = frozenset(("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN"))
_UNSET = object()
#: A part is not cut smaller than this many bytes of values (small batches stay on one
#: connection: below it, handing work to another thread costs more than it saves).
_MIN_PART_BYTES = 1 << 20


class _Op:
    """How to send and read one kind of command for the keys of a batch."""

    value_bytes = 64  # bytes per key moved, for windows and parts

    def commands(self, indices: Sequence[int]) -> list[bytes | memoryview]:
        raise NotImplementedError

    def read(self, conn: RedisConnection, i: int, last: bool) -> Any:
        return conn.read_reply()


class _Simple(_Op):
    """``<name> key`` for every key (``PTTL``, ``DEL``)."""

    def __init__(self, name: bytes, keys: Sequence[bytes]) -> None:
        self.head = b"*2\r\n$%d\r\n%s\r\n" % (len(name), name)
        self.keys = keys

    def commands(self, indices: Sequence[int]) -> list[bytes | memoryview]:
        keys, head = self.keys, self.head
        return [b"".join(b"%s$%d\r\n%s\r\n" % (head, len(keys[i]), keys[i]) for i in indices)]


class _Get(_Op):
    """``GET`` of values laid out as ``head_lens[i]`` header bytes + ``len(targets[i])``
    payload bytes."""

    def __init__(
        self,
        keys: Sequence[bytes],
        targets: Sequence[memoryview],
        head_lens: Sequence[int],
        accept: Callable[[int, bytes], object] | None,
        spill: Callable[[int, int], memoryview] | None = None,
    ) -> None:
        self.keys = keys
        self.targets = targets
        self.head_lens = head_lens
        self.accept = accept
        self.spill = spill
        sizes = [h + len(t) for h, t in zip(head_lens, targets, strict=True)] or [0]
        self.value_bytes = max(1, max(sizes))
        # An upper bound of any reply's length line + header, received ahead with a CRLF.
        self.next_hint = len(b"$%d\r\n" % self.value_bytes) + max(head_lens, default=0)

    def commands(self, indices: Sequence[int]) -> list[bytes | memoryview]:
        keys = self.keys
        return [
            b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(keys[i]), keys[i]) for i in indices)
        ]

    def read(self, conn: RedisConnection, i: int, last: bool) -> Any:
        hint = 0 if last else self.next_hint
        accept = self.accept
        check = None if accept is None else (lambda header: accept(i, header))
        spill = self.spill
        into = None if spill is None else (lambda n: spill(i, n))
        return conn.read_value_into(self.head_lens[i], self.targets[i], hint, check, into)


class _Set(_Op):
    """``SET key value [PX ttl]``, each value a header and a payload sent as they are."""

    def __init__(
        self,
        keys: Sequence[bytes],
        value_of: Callable[[int], tuple[bytes, memoryview]],
        value_bytes: int,
        ttl_ms: int | None,
    ) -> None:
        self.keys = keys
        self.value_of = value_of
        self.value_bytes = value_bytes
        self.argc = 3 if ttl_ms is None else 5
        self.tail = b"\r\n" if ttl_ms is None else b"\r\n" + encode_command("PX", ttl_ms)[4:]

    def commands(self, indices: Sequence[int]) -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        keys, tail = self.keys, self.tail
        for i in indices:
            header, payload = self.value_of(i)  # on the part's thread: checksums in parallel
            key = keys[i]
            out.append(
                b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
                % (self.argc, len(key), key, len(header) + payload.nbytes, header)
            )
            out.append(payload)
            out.append(tail)
        return out


class RedisTransport:
    """Commands to a Redis / Valkey server or Cluster (see the module docstring)."""

    def __init__(
        self,
        url: RedisURL,
        timeout_s: float,
        *,
        connections: int = 4,
        pipeline_bytes: int = 16 << 20,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.connections = connections
        self.pipeline_bytes = pipeline_bytes
        self.max_backoff_s = max_backoff_s
        self._tls = tls_context(url.tls_options) if url.tls else None
        self._pools: dict[Address, list[RedisConnection]] = {}
        self._lock = threading.Lock()
        self._slots = SlotMap(url.nodes, self.connect) if url.cluster else None
        self._workers = ThreadPoolExecutor(
            max_workers=4 * connections if url.cluster else connections,
            thread_name_prefix="kvo-remote-part",
        )
        self._closed = False
        # Health: written by the threads that run operations, read anywhere.
        #: Until when the server is marked down (``time.monotonic()``).
        self.down_until = 0.0
        self._backoff_s = _MIN_BACKOFF_S
        self._counters: Counter[str] = Counter()
        self._warned_moved = False

    def connect(self, address: Address) -> RedisConnection:
        """A new connection to ``address`` (authenticated; the URL's db selected standalone)."""
        url = self.url
        return RedisConnection(
            address[0],
            address[1],
            self.timeout_s,
            tls=self._tls,
            username=url.username,
            password=url.password,
            db=0 if url.cluster else url.db,
        )

    def start(self) -> None:
        """Check that the server answers (Cluster: read its slot map). Raises what went wrong:
        ``OSError``, or :class:`~kvoffload.tiers.redis.connection.RespErrorRaised` for a refusal
        (credentials, a server without Cluster mode addressed as a Cluster)."""
        if self._slots is not None:
            self._slots.refresh()
            return
        conn = self.connect(self.url.nodes[0])
        self._release(conn)

    def nodes(self) -> list[Address]:
        """The servers that hold keys: the one server, or the Cluster's masters."""
        return self._slots.masters if self._slots is not None else [self.url.nodes[0]]

    # ------------------------------------------------------------------ health

    def is_down(self) -> bool:
        """Marked down: operations fail at once until ``down_until`` (``time.monotonic()``)."""
        return time.monotonic() < self.down_until

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def mark_up(self) -> None:
        if self._backoff_s != _MIN_BACKOFF_S:
            self._backoff_s = _MIN_BACKOFF_S
            self._count("reconnects")
            log.info("remote tier %s reachable again", self.url.redacted())

    def mark_down(self, exc: BaseException) -> None:
        self._count("connection_errors")
        self.down_until = time.monotonic() + self._backoff_s
        log.warning(
            "remote tier %s failed (%s: %s); retrying in %.2f s",
            self.url.redacted(),
            type(exc).__name__,
            self.url.scrub(str(exc)),
            self._backoff_s,
        )
        self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s)

    # -------------------------------------------------------------- operations

    def get_into(
        self,
        keys: Sequence[bytes],
        targets: Sequence[memoryview],
        head_lens: Sequence[int],
        accept: Callable[[int, bytes], object] | None = None,
        spill: Callable[[int, int], memoryview] | None = None,
    ) -> list[Any]:
        """``GET`` each key, a value of ``head_lens[i]`` header bytes and ``len(targets[i])``
        payload bytes received into ``targets[i]`` unless ``accept(i, header)`` (called on the
        receiving thread) refuses it (results: ``read_value_into``'s). With ``spill``, a shorter
        value's ``n`` payload bytes go into ``spill(i, n)`` instead."""
        return self._run(keys, _Get(keys, targets, head_lens, accept, spill))

    def set_values(
        self,
        keys: Sequence[bytes],
        value_of: Callable[[int], tuple[bytes, memoryview]],
        value_bytes: int,
        ttl_ms: int | None,
    ) -> list[Any]:
        """``SET`` each key to ``value_of(i)`` (header, payload), called on the thread that
        sends it; ``b"OK"`` per stored key."""
        return self._run(keys, _Set(keys, value_of, value_bytes, ttl_ms))

    def ttls(self, keys: Sequence[bytes]) -> list[Any]:
        """``PTTL`` of each key: -2 missing, -1 no expiry, else milliseconds left."""
        return self._run(keys, _Simple(b"PTTL", keys))

    def delete(self, keys: Sequence[bytes]) -> list[Any]:
        return self._run(keys, _Simple(b"DEL", keys))

    def server_figures(self) -> dict[str, int]:
        """Capacity, use, key count and eviction counters, summed over the (master) nodes;
        ``cluster_enabled`` is 1 if a node runs in Cluster mode. Raises ``OSError`` (the
        server is then marked down) or ``ValueError`` for replies that are not ``INFO``."""
        figures: Counter[str] = Counter()
        sections = [encode_command("INFO", s) for s in ("memory", "stats", "keyspace", "cluster")]
        for address in self.nodes():
            try:
                conn, _ = self._acquire(address)
            except OSError as exc:
                self.mark_down(exc)
                raise
            try:
                conn.begin()
                conn.send([b"".join(sections)])
                replies = [conn.read_reply() for _ in sections]
            except OSError as exc:
                conn.close()
                self.mark_down(exc)
                raise
            self._release(conn)
            if not all(isinstance(reply, bytes) for reply in replies):
                raise ValueError(f"INFO answered {replies!r}")
            figures.update(_info_figures(b"".join(replies), self.url.db))
        return dict(figures)

    # ------------------------------------------------------------- the engine

    def _run(self, keys: Sequence[bytes], op: _Op) -> list[Any]:
        n = len(keys)
        if self._closed or self.is_down():
            return [DOWN] * n
        results: list[Any] = [_UNSET] * n
        parts = self._parts(keys, op, results)
        failures: list[BaseException | None] = []
        if parts:
            futures = [self._workers.submit(self._run_part, *p, op, results) for p in parts[1:]]
            failures.append(self._run_part(*parts[0], op, results))
            failures.extend(f.result() for f in futures)
        broken = next((f for f in failures if f is not None), None)
        unrouted = next((r for r in results if r is _UNSET), None)
        if broken is None and unrouted is not None:
            broken = ConnectionError("no master serves some keys' slots (failover in progress)")
        for i, r in enumerate(results):
            if r is _UNSET:
                results[i] = broken
        if broken is not None:
            self.mark_down(broken)
            self._refresh_slots()
        else:
            self.mark_up()
            if any(isinstance(r, RespError) and r.kind in _REROUTE for r in results):
                self._rerouted()
        return results

    def _parts(
        self, keys: Sequence[bytes], op: _Op, results: list[Any]
    ) -> list[tuple[Address, list[int]]]:
        """The keys' indices per node, each node's cut into up to ``connections`` parts."""
        if self._slots is None:
            groups = {self.url.nodes[0]: list(range(len(keys)))}
        else:
            groups = {}
            node_of = self._slots.node_of
            for i, key in enumerate(keys):
                address = node_of(key)
                if address is not None:
                    groups.setdefault(address, []).append(i)
        min_part = max(1, _MIN_PART_BYTES // op.value_bytes)
        parts = []
        for address, indices in groups.items():
            count = max(1, min(self.connections, len(indices) // min_part))
            step = math.ceil(len(indices) / count)
            parts += [(address, indices[i : i + step]) for i in range(0, len(indices), step)]
        return parts

    def _run_part(
        self, address: Address, indices: list[int], op: _Op, results: list[Any]
    ) -> BaseException | None:
        """Pipeline ``indices`` on one connection to ``address``; on a failure the part's
        unanswered keys get the error (returned). A pooled connection the server closed while
        it sat idle (it fails before any reply) is replaced once: every command is idempotent."""
        error: BaseException | None = None
        for attempt in range(2):
            try:
                conn, pooled = self._acquire(address)
            except Exception as exc:  # unreachable, or a refusal (credentials changed)
                error = exc if isinstance(exc, OSError) else ConnectionError(str(exc))
                for i in indices:
                    results[i] = error
                return error
            error = self._pipeline(conn, indices, op, results)
            if error is None:
                self._release(conn)
                return None
            conn.close()
            idle_drop = pooled and not isinstance(error, TimeoutError)
            if not (attempt == 0 and idle_drop and results[indices[0]] is _UNSET):
                break
        for i in indices:
            if results[i] is _UNSET:
                results[i] = error
        return error

    def _pipeline(
        self, conn: RedisConnection, indices: list[int], op: _Op, results: list[Any]
    ) -> BaseException | None:
        """Send ``indices``' commands in windows and read their replies into ``results``;
        the error that stopped it (the connection is then unusable), else ``None``."""
        window = max(1, self.pipeline_bytes // op.value_bytes)
        try:
            conn.begin()  # one deadline per window: its replies and the next window's send
            conn.send(op.commands(indices[:window]))
            for start in range(0, len(indices), window):
                if start:
                    conn.begin()
                chunk = indices[start : start + window]
                following = indices[start + window : start + 2 * window]
                if following:
                    conn.send(op.commands(following))
                last = chunk[-1] if not following else -1
                for i in chunk:
                    results[i] = op.read(conn, i, i == last)
        except Exception as exc:  # a timeout, a broken stream (or a bug): this part fails
            if not isinstance(exc, OSError):
                log.error("remote tier: %s", self.url.scrub(repr(exc)))
            return exc
        return None

    def _acquire(self, address: Address) -> tuple[RedisConnection, bool]:
        """A connection to ``address`` and whether it came from the pool (else: new)."""
        with self._lock:
            pool = self._pools.get(address)
            if pool:
                return pool.pop(), True
        return self.connect(address), False

    def _release(self, conn: RedisConnection) -> None:
        if conn.broken or self._closed:
            conn.close()
            return
        with self._lock:
            self._pools.setdefault(conn.address, []).append(conn)

    def _refresh_slots(self) -> None:
        """Follow a failover or resharding: re-read the slot map (best effort); drop the pools
        of nodes that no longer serve slots."""
        if self._slots is None:
            return
        try:
            self._slots.refresh()
        except Exception as exc:  # no node answered: keep the old map, try again next failure
            log.debug("remote tier: slot map refresh failed: %s", self.url.scrub(str(exc)))
            return
        masters = set(self._slots.masters)
        with self._lock:
            gone = [a for a in self._pools if a not in masters]
            stale = [conn for a in gone for conn in self._pools.pop(a)]
        for conn in stale:
            conn.close()

    def _rerouted(self) -> None:
        if self._slots is not None:
            self._refresh_slots()
        elif not self._warned_moved:
            self._warned_moved = True
            log.warning(
                "remote tier %s answered MOVED: it is a Redis Cluster node; use %s",
                self.url.redacted(),
                self.url.redacted().replace("://", "+cluster://", 1).rsplit("/", 1)[0],
            )

    def close(self) -> None:
        """Close every connection; later operations fail at once. Idempotent."""
        self._closed = True
        self._workers.shutdown(wait=True)
        with self._lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            for conn in pool:
                conn.close()


def _info_figures(text: bytes, db: int) -> dict[str, int]:
    """The tier's figures from ``INFO`` text."""
    info: dict[str, str] = {}
    for line in text.decode(errors="replace").splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("#"):
            info[name] = value
    keyspace = dict(
        part.split("=", 1) for part in info.get(f"db{db}", "").split(",") if "=" in part
    )
    maxmemory = int(info.get("maxmemory", 0))
    return {
        "capacity_bytes": maxmemory or int(info.get("total_system_memory", 0)),
        "used_bytes": int(info.get("used_memory", 0)),
        "evicted_keys": int(info.get("evicted_keys", 0)),
        "expired_keys": int(info.get("expired_keys", 0)),
        "keys": int(keyspace.get("keys", 0)),
        "cluster_enabled": int(info.get("cluster_enabled", 0)),
    }
