"""The encoded payload of a block: a small frame header, then the codec's body.

::

    offset  size  field
    0       2     magic b"KC"
    2       1     codec id (:data:`LOSSLESS_ID`, :data:`FP8_ID`)
    3       1     codec parameter (lossless: element width in bytes; fp8: the source dtype's id)
    4       4     raw length: bytes the block has once decoded (u32, little-endian)
    8       ...   body

A block whose header (:mod:`~kvoffload.tiers.blockformat`) says *encoded* carries this frame as
its payload; the header's checksum covers the frame as stored.
"""

from __future__ import annotations

import struct

from kvoffload.tiers.blockformat import CorruptBlockError

__all__ = ["FP8_ID", "FRAME", "LOSSLESS_ID", "pack_frame_header", "unpack_frame_header"]

FRAME = struct.Struct("<2sBBI")
_MAGIC = b"KC"
LOSSLESS_ID = 1
FP8_ID = 2


def pack_frame_header(codec_id: int, param: int, raw_len: int) -> bytes:
    return FRAME.pack(_MAGIC, codec_id, param, raw_len)


def unpack_frame_header(stored: memoryview | bytes) -> tuple[int, int, int]:
    """``(codec id, parameter, raw length)``; :class:`CorruptBlockError` for a bad frame."""
    if len(stored) < FRAME.size:
        raise CorruptBlockError("corrupt", f"an encoded payload of {len(stored)} bytes")
    magic, codec_id, param, raw_len = FRAME.unpack_from(stored, 0)
    if magic != _MAGIC:
        raise CorruptBlockError("corrupt", "bad codec frame magic")
    return codec_id, param, raw_len
