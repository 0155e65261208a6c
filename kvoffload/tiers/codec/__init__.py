"""Block codecs of the disk and remote tiers: what a block's bytes become when stored.

* ``none``: the host slot's bytes as they are (the block format's version 1 payload);
* ``lossless``: byte planes + zstd (:mod:`.lossless`); decodes to the exact bytes;
* ``fp8``: fp8 e4m3 with a scale per head vector (:mod:`.fp8`); lossy, opt-in only.

:class:`BlockCodec` is what a tier holds: :meth:`BlockCodec.encode` on a store's I/O thread
(``None``: store the slot as it is, the block did not get smaller), :meth:`BlockCodec.decode` on
a load's I/O thread, never on the scheduler's. A lossy codec also renames the layout
(:meth:`BlockCodec.stored_layout`): its blocks live under another fingerprint (another disk
namespace, another Redis key prefix, another header fingerprint), so a tier configured lossless
(or raw) never reads a lossy block, and a lossy tier never reads an exact one as its own.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from kvoffload.errors import ConfigError
from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.codec.fp8 import FP8_DTYPES, decode_fp8, encode_fp8
from kvoffload.tiers.codec.frame import FP8_ID, LOSSLESS_ID, unpack_frame_header
from kvoffload.tiers.codec.lossless import decode_lossless, encode_lossless
from kvoffload.tiers.contract import KVLayout

__all__ = [
    "AUTO_MARGIN",
    "AUTO_RATIO_FLOOR",
    "COMPRESSION_CHOICES",
    "BlockCodec",
    "CodecStats",
    "check_compression",
    "lossy_layout",
]

#: The values of a tier's ``compression`` setting.
COMPRESSION_CHOICES = ("none", "lossless", "auto", "fp8")
#: ``auto`` compresses a capacity-bound tier only when blocks get at least this much smaller.
AUTO_RATIO_FLOOR = 1.1
#: ``auto`` encodes for speed only when the I/O time it saves is this many times what the codec
#: costs (the figures are measured on a machine whose load varies).
AUTO_MARGIN = 2.0
#: ``auto`` encodes one block in this many while it stores raw, to keep measuring the codec.
AUTO_SAMPLE_EVERY = 32
_WIDTHS = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.float64": 8}


def lossy_layout(layout: KVLayout) -> KVLayout:
    """The layout a lossy (fp8) tier stores ``layout``'s blocks under."""
    return dataclasses.replace(layout, dtype=f"{layout.dtype}+fp8-e4m3-head-scale")


def _element_width(dtype: str) -> int:
    """Bytes per KV element of ``dtype`` (``str(torch dtype)``, or vLLM's spelling without
    ``torch.``); 1 (no byte planes) for a dtype not known here."""
    dtype = str(dtype)
    return _WIDTHS.get(dtype if dtype.startswith("torch.") else f"torch.{dtype}", 1)


def check_compression(field: str, value: object) -> str:
    """``value`` if it is one of :data:`COMPRESSION_CHOICES`, else :class:`ConfigError`."""
    if not isinstance(value, str) or value not in COMPRESSION_CHOICES:
        raise ConfigError(field, f"must be one of {list(COMPRESSION_CHOICES)}, got {value!r}")
    return value


class CodecStats:
    """Bytes before and after encoding, and seconds spent encoding and decoding (any thread)."""

    __slots__ = (
        "_lock",
        "decode_s",
        "decoded_blocks",
        "encode_s",
        "encoded_blocks",
        "raw_bytes",
        "stored_bytes",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.raw_bytes = self.stored_bytes = 0
        self.encoded_blocks = self.decoded_blocks = 0
        self.encode_s = self.decode_s = 0.0

    def add_encode(self, raw: int, stored: int, seconds: float) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.stored_bytes += stored
            self.encoded_blocks += 1
            self.encode_s += seconds

    def add_decode(self, seconds: float) -> None:
        with self._lock:
            self.decoded_blocks += 1
            self.decode_s += seconds

    @property
    def ratio(self) -> float:
        """Raw bytes per stored byte of the blocks encoded so far (1.0 before any)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_stats(self) -> dict[str, int]:
        """For a tier's ``stats()`` (counters): ``codec_raw_bytes``, ``codec_stored_bytes`` (their
        quotient is the ratio), ``codec_encode_us``, ``codec_decode_us`` and the block counts."""
        return {
            "codec_raw_bytes": self.raw_bytes,
            "codec_stored_bytes": self.stored_bytes,
            "codec_encoded_blocks": self.encoded_blocks,
            "codec_decoded_blocks": self.decoded_blocks,
            "codec_encode_us": round(self.encode_s * 1e6),
            "codec_decode_us": round(self.decode_s * 1e6),
        }


class BlockCodec:
    """A tier's codec for blocks of ``layout`` (module docstring). ``mode`` is the tier's
    ``compression`` setting; ``auto`` encodes like ``lossless`` when :meth:`wanted` says so."""

    def __init__(self, mode: str, layout: KVLayout, field: str = "compression") -> None:
        check_compression(field, mode)
        if mode == "fp8" and layout.dtype not in FP8_DTYPES:
            raise ConfigError(field, f"fp8 encodes {sorted(FP8_DTYPES)} KV, not {layout.dtype}")
        vector = layout.head_dim * _element_width(layout.dtype)
        if mode == "fp8" and (layout.head_dim <= 0 or layout.block_bytes % vector):
            raise ConfigError(
                field,
                f"fp8 scales each head vector: it needs blocks of whole head vectors, not "
                f"{layout.block_bytes} bytes with head_dim {layout.head_dim} (vLLM's layouts "
                "carry no head size)",
            )
        self.mode = mode
        self.lossy = mode == "fp8"
        self.layout = layout
        self._width = _element_width(layout.dtype)
        self.stats = CodecStats()
        self._auto = _AutoChoice(self.stats, layout.block_bytes)

    @property
    def encodes(self) -> bool:
        """Whether stores may encode (``none`` never does)."""
        return self.mode != "none"

    def stored_layout(self, layout: KVLayout) -> KVLayout:
        """The layout blocks are stored under: ``layout`` itself unless lossy, whose blocks get
        a layout of their own (another fingerprint: never mixed with exact blocks)."""
        return lossy_layout(layout) if self.lossy else layout

    def encode(self, raw: memoryview) -> bytes | None:
        """The stored form of ``raw``, or ``None`` to store it as it is (mode ``none``, or the
        encoded form is not smaller). Counted in :attr:`stats`."""
        if self.mode == "none":
            return None
        if self.mode == "auto" and not self._auto.should_encode():
            return None
        start = time.perf_counter()
        if self.lossy:
            encoded = encode_fp8(raw, self.layout.dtype, self.layout.head_dim)
        else:
            encoded = encode_lossless(raw, self._width)
        seconds = time.perf_counter() - start
        stored = encoded if len(encoded) < len(raw) else None
        self.stats.add_encode(len(raw), len(raw) if stored is None else len(stored), seconds)
        return stored

    def note_io(self, nbytes: int, seconds: float) -> None:
        """A tier's I/O thread moved ``nbytes`` stored bytes in ``seconds`` (feeds ``auto``)."""
        if self.mode == "auto":
            self._auto.note_io(nbytes, seconds)

    def note_capacity_bound(self) -> None:
        """The tier evicted to make room: its capacity, not its speed, limits it (``auto``
        then compresses whenever the ratio is above :data:`AUTO_RATIO_FLOOR`)."""
        self._auto.capacity_bound = True

    def decode(self, stored: memoryview, out: memoryview) -> None:
        """Decode an encoded payload into ``out``. :class:`CorruptBlockError` for a frame this
        codec must not serve: a lossy frame in an exact tier (or the reverse), a raw length
        other than ``len(out)``, a body that does not decode."""
        start = time.perf_counter()
        codec_id, param, raw_len = unpack_frame_header(stored)
        if raw_len != len(out):
            raise CorruptBlockError(
                "corrupt", f"frame of {raw_len} bytes for a {len(out)}-byte slot"
            )
        if codec_id == LOSSLESS_ID and not self.lossy:
            decode_lossless(stored, param, out)
        elif codec_id == FP8_ID and self.lossy:
            decode_fp8(stored, param, self.layout.head_dim, out)
        else:
            raise CorruptBlockError("corrupt", f"codec id {codec_id} in a {self.mode} tier")
        self.stats.add_decode(time.perf_counter() - start)


class _AutoChoice:
    """``auto``'s decision, from what the tier measured (any thread; the sample tick is not
    locked: a sample more or less).

    Encoding pays when :data:`AUTO_MARGIN` times the codec's seconds per raw byte (encode +
    decode) are less than the I/O seconds it saves: ``io_s_per_byte * (1 - 1 / ratio)``; or, for a capacity-bound tier, when
    the ratio is at least :data:`AUTO_RATIO_FLOOR`. Until both figures exist, and one block in
    :data:`AUTO_SAMPLE_EVERY` afterwards, a block is encoded to measure the codec.
    """

    def __init__(self, stats: CodecStats, block_bytes: int) -> None:
        self._stats = stats
        self._block_bytes = block_bytes
        self._lock = threading.Lock()
        self._io_bytes = 0
        self._io_s = 0.0
        self._tick = 0
        self.capacity_bound = False

    def note_io(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._io_bytes += nbytes
            self._io_s += seconds

    def should_encode(self) -> bool:
        self._tick += 1
        if self._tick % AUTO_SAMPLE_EVERY == 1:
            return True
        return self.pays()

    def pays(self) -> bool:
        """Whether encoding saves time (or room, capacity-bound) by the figures so far."""
        stats = self._stats
        if not stats.encoded_blocks:
            return False
        ratio = stats.ratio
        if self.capacity_bound and ratio >= AUTO_RATIO_FLOOR:
            return True
        if not self._io_bytes or ratio <= 1.0:
            return False
        codec_s = stats.encode_s / stats.raw_bytes
        if stats.decoded_blocks:
            codec_s += stats.decode_s / (stats.decoded_blocks * self._block_bytes)
        else:
            codec_s *= 2  # decoding is not measured yet: assume it costs what encoding does
        return codec_s * AUTO_MARGIN < self._io_s / self._io_bytes * (1 - 1 / ratio)
