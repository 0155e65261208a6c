"""Blocks as Redis values: what a store sends and how a load checks what it receives.

A value is the :mod:`~kvoffload.tiers.blockformat` header (``align=8``) followed by the host
slot's bytes. :class:`RemoteBlocks` turns a job's ``(key, slot)`` pairs into transport calls:

* **store**: ``SET`` of each block, its header (with the payload's xxh3-64) computed on the
  thread that sends it, the payload sent from the slot as it is (``SET ... PX`` with a TTL);
* **load**: ``GET`` straight into the slots. Each header is checked as it arrives, before its
  payload is received: a value of another layout, another key or the wrong length never reaches
  its slot. The payload's checksum is computed as it lands and compared with the header's; a
  mismatch fails the block (its slot then holds the bad bytes; the caller frees it). Values that
  can never be served (damaged, another layout, the wrong type or length) are deleted.

With a codec that encodes (``compression``: ``lossless``, ``auto``, ``fp8``), a store sends each
block's codec frame (encoded on the sending thread) under an encoded header whose checksum covers
the frame; a load receives a value shorter than a raw block into a buffer of its own, checks its
checksum, and decodes it into the slot (on the receiving thread, never the scheduler's). Raw
values (of any tier on the server) are still received straight into their slots.

Runs on the tier's I/O thread; the transport spreads each call over connections and shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvoffload.keys import OffloadKey
from kvoffload.tiers.blockformat import (
    BlockHeader,
    CorruptBlockError,
    encode_header,
    header_size,
    parse_header,
    payload_checksum,
)
from kvoffload.tiers.codec import BlockCodec
from kvoffload.tiers.contract import KVLayout
from kvoffload.tiers.redis.config import VALUE_ALIGN, remote_key_prefix
from kvoffload.tiers.redis.messages import failure_cause
from kvoffload.tiers.redis.transport import RedisTransport

__all__ = ["JobOutcome", "RemoteBlocks"]

log = logging.getLogger(__name__)

#: Load failures that mean the value can never be served: it is deleted.
_DAMAGE = frozenset(("corrupt", "layout", "checksum"))


class JobOutcome:
    """What the I/O thread found for a job: failed keys by cause, payload bytes moved, seconds,
    and when its stores were sent (the start of their server-side TTL)."""

    __slots__ = ("failed", "num_bytes", "seconds", "sent_at")

    def __init__(self, failed: dict[OffloadKey, str], num_bytes: int, sent_at: float) -> None:
        self.failed = failed
        self.num_bytes = num_bytes
        self.sent_at = sent_at
        self.seconds = 0.0


class RemoteBlocks:
    """Stores and loads of host slots through ``transport`` (module docstring)."""

    def __init__(
        self,
        pool: memoryview,
        layout: KVLayout,
        transport: RedisTransport,
        ttl_ms: int | None,
        namespace: str = "",
        codec: BlockCodec | None = None,
    ) -> None:
        self._flat = pool.cast("B") if pool.format != "B" or pool.ndim != 1 else pool
        self._num_slots = len(pool)  # rows of the 2-D pool
        self._size = layout.block_bytes
        self.codec = codec if codec is not None else BlockCodec("none", layout)
        stored = self.codec.stored_layout(layout)  # a lossy codec's blocks: a layout of their own
        self._fingerprint = stored.fingerprint()
        self.prefix = remote_key_prefix(stored, namespace)
        self._transport = transport
        self._ttl_ms = ttl_ms

    def slot(self, slot: int) -> memoryview:
        """The bytes of host slot ``slot`` (``IndexError`` outside the pool)."""
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"slot {slot} is outside the host pool ({self._num_slots} slots)")
        size = self._size
        return self._flat[slot * size : (slot + 1) * size]

    def store(self, work: list[tuple[OffloadKey, int]]) -> JobOutcome:
        fp, size, codec = self._fingerprint, self._size, self.codec
        payloads = [self.slot(slot) for _, slot in work]
        encode = _safe_encoder(codec) if codec.encodes else None
        stored_bytes = [size] * len(work)

        def value_of(i: int) -> tuple[bytes, memoryview]:
            key, payload = work[i][0], payloads[i]
            frame = None if encode is None else encode(payload)
            if frame is None:
                return encode_header(fp, key, size, payload_checksum(payload), VALUE_ALIGN), payload
            stored_bytes[i] = len(frame)
            view = memoryview(frame)
            return encode_header(
                fp, key, len(frame), payload_checksum(view), VALUE_ALIGN, encoded=True
            ), view

        value_bytes = header_size(len(work[0][0]), VALUE_ALIGN) + size
        sent_at = time.monotonic()
        results = self._transport.set_values(
            [self.prefix + key for key, _ in work], value_of, value_bytes, self._ttl_ms
        )
        codec.note_io(sum(stored_bytes), time.monotonic() - sent_at)
        failed = {
            key: failure_cause(result)
            for (key, _), result in zip(work, results, strict=True)
            if result != b"OK"
        }
        return JobOutcome(failed, (len(work) - len(failed)) * size, sent_at)

    def load(self, work: list[tuple[OffloadKey, int]]) -> JobOutcome:
        fp, size = self._fingerprint, self._size
        headers: list[BlockHeader | None] = [None] * len(work)
        frames: dict[int, memoryview] = {}  # encoded payloads, received beside their slots

        def accept(i: int, raw: bytes) -> str | None:
            try:
                header = parse_header(raw, fp, work[i][0], VALUE_ALIGN)
            except CorruptBlockError as exc:
                return exc.cause
            if header.header_len != len(raw):
                return "corrupt"
            frame = frames.get(i)  # an encoded value is shorter than a raw one, a raw one exact
            if header.encoded:
                if frame is None or header.payload_len != len(frame):
                    return "corrupt"
            elif frame is not None or header.payload_len != size:
                return "corrupt"
            headers[i] = header
            return None

        def spill(i: int, n: int) -> memoryview:
            frames[i] = view = memoryview(bytearray(n))
            return view

        rkeys = [self.prefix + key for key, _ in work]
        started = time.monotonic()
        results = self._transport.get_into(
            rkeys,
            [self.slot(slot) for _, slot in work],
            [header_size(len(key), VALUE_ALIGN) for key, _ in work],
            accept,
            spill,
        )
        failed: dict[OffloadKey, str] = {}
        damaged: list[bytes] = []
        self.codec.note_io(
            sum(len(frames[i]) if i in frames else size for i in range(len(work))),
            time.monotonic() - started,
        )
        for i, result in enumerate(results):
            cause = _load_cause(result, headers[i])
            if cause is None and i in frames:
                cause = self._decode(frames[i], work[i][1])
            if cause is not None:
                failed[work[i][0]] = cause
                if cause in _DAMAGE:
                    damaged.append(rkeys[i])
        if damaged:  # best effort: values that can never be served go
            self._transport.delete(damaged)
        return JobOutcome(failed, (len(work) - len(failed)) * size, 0.0)


    def _decode(self, frame: memoryview, slot: int) -> str | None:
        """Decode a verified frame into ``slot``: ``None``, or the cause it cannot be served."""
        try:
            self.codec.decode(frame, self.slot(slot))
        except CorruptBlockError as exc:
            return exc.cause
        return None


def _safe_encoder(codec: BlockCodec) -> Callable[[memoryview], bytes | None]:
    """``codec.encode``, a failure of which stores the block as it is (logged once per job)."""
    logged = False

    def encode(payload: memoryview) -> bytes | None:
        nonlocal logged
        try:
            return codec.encode(payload)
        except Exception:
            if not logged:
                logged = True
                log.exception("remote tier: encoding a block failed; stored raw")
            return None

    return encode


def _load_cause(result: Any, header: BlockHeader | None) -> str | None:
    """``None`` if ``result`` (of ``get_into``) is an intact block whose accepted ``header``
    states its checksum, else the cause of the failure."""
    if isinstance(result, tuple):
        if header is None:  # a value received without an accepted header: never served
            return "corrupt"
        return None if result[1] == header.checksum else "checksum"
    if result is None:
        return "missing"
    return result if isinstance(result, str) else failure_cause(result)
