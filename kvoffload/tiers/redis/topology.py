"""Where a key lives: one server, or the master of its hash slot in a Redis Cluster.

:class:`SlotMap` reads ``CLUSTER SLOTS`` from any node that answers (the masters it knows, then
the seed nodes of the URL) and maps each of the 16384 hash slots to its master's address. It is
re-read on demand: after a connection to a master failed (a failover promotes its replica) or a
node answered ``MOVED`` (slots moved). A slot whose master is gone and not replaced yet maps to
``None``: its keys fail until a refresh finds a new master.
"""

from __future__ import annotations

import threading
from binascii import crc_hqx
from collections.abc import Callable, Sequence

from kvoffload.tiers.redis.connection import ProtocolError, RedisConnection

__all__ = ["NUM_SLOTS", "Address", "SlotMap", "key_slot"]

NUM_SLOTS = 16384
Address = tuple[str, int]


def key_slot(key: bytes) -> int:
    """The hash slot of ``key``, as Redis computes it (CRC16-XMODEM of the key, or of its
    ``{hash tag}`` when it has a non-empty one)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc_hqx(key, 0) % NUM_SLOTS


class SlotMap:
    """The masters of a Cluster's hash slots (see the module docstring). Thread-safe: readers see
    either the old map or the new one."""

    def __init__(
        self, seeds: Sequence[Address], connect: Callable[[Address], RedisConnection]
    ) -> None:
        self._seeds = list(seeds)
        self._connect = connect
        self._slots: list[Address | None] = [None] * NUM_SLOTS
        self._masters: list[Address] = []
        self._lock = threading.Lock()

    @property
    def masters(self) -> list[Address]:
        """The addresses of the masters that serve slots, as last read."""
        return self._masters

    def node_of(self, key: bytes) -> Address | None:
        """The master serving ``key``'s slot (``None``: no master known for it now)."""
        return self._slots[key_slot(key)]

    def refresh(self) -> None:
        """Re-read the slot map from the first node that answers; the last error is raised
        when none does (a server without Cluster mode answers with an error reply)."""
        with self._lock:
            last: BaseException | None = None
            for address in dict.fromkeys([*self._masters, *self._seeds]):
                try:
                    conn = self._connect(address)
                except OSError as exc:
                    last = exc
                    continue
                try:
                    reply = conn.call("CLUSTER", "SLOTS")
                except Exception as exc:  # an error reply (no Cluster mode), a broken stream
                    last = exc
                    continue
                finally:
                    conn.close()
                self._apply(reply, address)
                return
            raise last if last is not None else ConnectionError("no Cluster node to ask for slots")

    def _apply(self, reply: list[list[object]], asked: Address) -> None:
        slots: list[Address | None] = [None] * NUM_SLOTS
        masters: dict[Address, None] = {}
        for entry in reply:
            start, end, master = entry[0], entry[1], entry[2]
            if not (isinstance(start, int) and isinstance(end, int) and isinstance(master, list)):
                raise ProtocolError(f"malformed CLUSTER SLOTS entry from {asked}: {entry!r}")
            host = master[0].decode() if isinstance(master[0], bytes) else ""
            if host in ("", "?"):  # the node does not know its own address: the one we asked
                host = asked[0]
            address = (host, int(master[1]))
            masters[address] = None
            slots[start : end + 1] = [address] * (end - start + 1)
        self._slots = slots
        self._masters = list(masters)
