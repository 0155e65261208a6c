"""The lossless codec: byte planes (:mod:`.planes`), each plane zstd-compressed or kept as it is.

Body after the frame header: ``width`` plane entries (u32 each: the plane's stored length, top bit
set when the plane is compressed), then the planes. A plane is kept compressed only when that
saves at least 1/32 of it (mantissa planes are close to random: storing them as they are costs
nothing to decode). zstd runs with a tiny match finder (hash and chain tables of 64 entries): on
KV planes the gain is nearly all entropy coding, and this setting compresses and decompresses
several times faster than level 1's default tables at the same ratio (``benchmarks/compression.py``).
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.codec.frame import FRAME, LOSSLESS_ID, pack_frame_header
from kvoffload.tiers.codec.planes import join_into, split

if TYPE_CHECKING:
    import zstandard

__all__ = ["decode_lossless", "encode_lossless"]

_ENTRY = struct.Struct("<I")
_COMPRESSED = 1 << 31
#: The tiny match finder's settings (``zstandard`` is imported on first use: a tier without
#: compression never needs it).
_PARAMS = {"min_match": 7, "search_log": 1, "hash_log": 6, "chain_log": 6}
# zstd contexts are not thread-safe: one pair per I/O thread.
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        import zstandard

        params = zstandard.ZstdCompressionParameters.from_level(1, **_PARAMS)
        c = _local.c = zstandard.ZstdCompressor(compression_params=params)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        import zstandard

        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _zstd_error() -> type[Any]:
    import zstandard

    return zstandard.ZstdError


def encode_lossless(raw: memoryview | bytes, width: int) -> bytes:
    """The frame of ``raw`` (a whole number of ``width``-byte elements; ``width`` 1 to 8)."""
    if not 1 <= width <= 8 or len(raw) % width:
        raise ValueError(f"{len(raw)} bytes are not a whole number of {width}-byte elements")
    n = len(raw) // width
    compress = _compressor().compress
    entries: list[bytes] = []
    bodies: list[bytes | memoryview] = []
    for plane in split(raw, width):
        packed = compress(plane)
        if len(packed) <= n - (n >> 5):
            entries.append(_ENTRY.pack(len(packed) | _COMPRESSED))
            bodies.append(packed)
        else:
            entries.append(_ENTRY.pack(n))
            bodies.append(plane)
    return b"".join([pack_frame_header(LOSSLESS_ID, width, len(raw)), *entries, *bodies])


def decode_lossless(stored: memoryview, width: int, out: memoryview) -> None:
    """Decode the frame ``stored`` (header already checked: codec, raw length ``len(out)``) into
    ``out``; :class:`CorruptBlockError` when the body does not decode to exactly that."""
    if not 1 <= width <= 8 or len(out) % width:
        raise CorruptBlockError("corrupt", f"element width {width} for {len(out)} bytes")
    n = len(out) // width
    at = FRAME.size + width * _ENTRY.size
    if len(stored) < at:
        raise CorruptBlockError("corrupt", "codec frame cut short")
    planes: list[bytes | memoryview] = []
    decompress = _decompressor().decompress
    for p in range(width):
        (entry,) = _ENTRY.unpack_from(stored, FRAME.size + p * _ENTRY.size)
        size = entry & ~_COMPRESSED
        body = stored[at : at + size]
        if len(body) != size:
            raise CorruptBlockError("corrupt", "codec frame cut short")
        at += size
        plane: bytes | memoryview = body
        if entry & _COMPRESSED:
            try:
                plane = decompress(body, max_output_size=n)
            except _zstd_error() as exc:
                raise CorruptBlockError(
                    "corrupt", f"plane {p} does not decompress: {exc}"
                ) from None
        if len(plane) != n:
            raise CorruptBlockError("corrupt", f"plane {p} is {len(plane)} bytes, expected {n}")
        planes.append(plane)
    if at != len(stored):
        raise CorruptBlockError("corrupt", f"{len(stored) - at} bytes after the codec frame")
    join_into(planes, width, out)
