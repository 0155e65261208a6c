"""The self-checking block format shared by the disk and remote tiers.

A stored block is a header followed by the payload (the host slot's bytes, unchanged, or encoded
by the tier's codec)::

    offset  size  field
    0       4     magic b"KVOB"
    4       2     format version (little-endian u16): 1, the payload is the host slot's bytes;
                  2 (:data:`ENCODED_VERSION`), the payload is a codec frame
                  (:mod:`kvoffload.tiers.codec`) that decodes to them
    6       2     key length K (u16)
    8       16    layout fingerprint (:meth:`KVLayout.fingerprint`)
    24      8     payload length (u64)
    32      8     payload checksum: xxh3-64 of the payload as stored (u64)
    40      8     header checksum: xxh3-64 of bytes [0, 40) + the key (u64)
    48      K     the block's OffloadKey
    48+K    pad   zeros up to a multiple of ``align`` (:data:`HEADER_ALIGN` on disk, so the payload
                  starts aligned for O_DIRECT; a remote store may use 8)

:func:`parse_header` accepts only a header whose magic, version, header checksum, fingerprint and
key are the expected ones; :func:`verify_payload` checks length and checksum. Each failure raises
:class:`CorruptBlockError` with the cause a :class:`~kvoffload.tiers.contract.TierJobResult` reports.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvoffload.errors import KVOffloadError

if TYPE_CHECKING:
    import mmap

__all__ = [
    "ENCODED_VERSION",
    "FORMAT_VERSION",
    "HEADER_ALIGN",
    "MAGIC",
    "BlockHeader",
    "CorruptBlockError",
    "encode_header",
    "header_size",
    "parse_header",
    "payload_checksum",
    "verify_payload",
]

MAGIC = b"KVOB"
FORMAT_VERSION = 1
#: The version of a block whose payload is a codec frame (older readers reject it: a recompute).
ENCODED_VERSION = 2
#: The header (with its padding) is a multiple of this many bytes.
HEADER_ALIGN = 4096
_FIXED = struct.Struct("<4sHH16sQQ")  # magic, version, key length, fingerprint, length, checksum
_CHECK = struct.Struct("<Q")
_KEY_AT = _FIXED.size + _CHECK.size  # 48


class CorruptBlockError(KVOffloadError):
    """A stored block cannot be served. ``cause``: ``"corrupt"``, ``"layout"`` or ``"checksum"``."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail

    def __reduce__(self) -> tuple[type[CorruptBlockError], tuple[str, str]]:
        return type(self), (self.cause, self.detail)  # pickles with both arguments


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A parsed header: where the payload starts and what it must hash to."""

    key: bytes
    payload_len: int
    checksum: int
    header_len: int
    #: The payload is a codec frame (format version 2), not the slot's bytes.
    encoded: bool = False


def header_size(key_len: int, align: int = HEADER_ALIGN) -> int:
    """Bytes the header of a key of ``key_len`` bytes takes, padded to a multiple of ``align``."""
    raw = _KEY_AT + key_len
    return -(-raw // align) * align


def payload_checksum(payload: memoryview | bytes) -> int:
    """xxh3-64 of the payload (any buffer; no copy).

    Hashed through a hasher's ``update``, which releases the GIL for inputs over 64 KiB
    (``xxh3_64_intdigest`` holds it): the I/O threads verify blocks in parallel. Same digest.
    """
    hasher = xxhash.xxh3_64()
    hasher.update(payload)
    return hasher.intdigest()


def encode_header(
    fingerprint: bytes,
    key: bytes,
    payload_len: int,
    checksum: int,
    align: int = HEADER_ALIGN,
    encoded: bool = False,
) -> bytes:
    """The header of a block, padded to :func:`header_size` ``(len(key), align)``; ``encoded``:
    the payload is a codec frame."""
    version = ENCODED_VERSION if encoded else FORMAT_VERSION
    fixed = _FIXED.pack(MAGIC, version, len(key), fingerprint, payload_len, checksum)
    check = _CHECK.pack(xxhash.xxh3_64_intdigest(fixed + key))
    raw = fixed + check + key
    return raw + bytes(header_size(len(key), align) - len(raw))


def parse_header(
    buf: bytes | bytearray | memoryview | mmap.mmap,
    fingerprint: bytes,
    key: bytes,
    align: int = HEADER_ALIGN,
) -> BlockHeader:
    """Parse and check the header at the start of ``buf`` for ``key`` under ``fingerprint``
    (``buf`` needs only the unpadded part; ``align`` as the block was written with)."""
    if len(buf) < _KEY_AT:
        raise CorruptBlockError("corrupt", f"{len(buf)} bytes are too short for a header")
    magic, version, key_len, stored_fp, length, checksum = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlockError("corrupt", f"bad magic {bytes(magic)!r}")
    if version not in (FORMAT_VERSION, ENCODED_VERSION):
        raise CorruptBlockError(
            "corrupt", f"format version {version}, expected {FORMAT_VERSION} or {ENCODED_VERSION}"
        )
    if len(buf) < _KEY_AT + key_len:
        raise CorruptBlockError("corrupt", "header cut short")
    (check,) = _CHECK.unpack_from(buf, _FIXED.size)
    stored_key = bytes(buf[_KEY_AT : _KEY_AT + key_len])
    if xxhash.xxh3_64_intdigest(bytes(buf[: _FIXED.size]) + stored_key) != check:
        raise CorruptBlockError("corrupt", "header checksum mismatch")
    if stored_fp != fingerprint:
        raise CorruptBlockError("layout", "the block was written for another KV layout")
    if stored_key != key:
        raise CorruptBlockError("corrupt", "the block holds another key")
    encoded = version == ENCODED_VERSION
    return BlockHeader(stored_key, length, checksum, header_size(key_len, align), encoded)


def verify_payload(header: BlockHeader, payload: memoryview | bytes) -> None:
    """Raise :class:`CorruptBlockError` unless ``payload`` is the block's full, intact payload."""
    if len(payload) != header.payload_len:
        raise CorruptBlockError(
            "corrupt", f"payload is {len(payload)} bytes, header says {header.payload_len}"
        )
    if payload_checksum(payload) != header.checksum:
        raise CorruptBlockError("checksum", "payload checksum mismatch")
