"""The disk tier's block files: names, atomic block writes, verified block reads.

Directory layout under the tier's root (one namespace per KV layout, so models never mix)::

    <root>/kvoffload-v2/<fingerprint hex>/ledger        shared byte count (8 bytes, under flock)
    <root>/kvoffload-v2/<fingerprint hex>/<aa>/<key hex>.kvb   one block: header + payload
    <root>/kvoffload-v2/<fingerprint hex>/<aa>/.<key hex>.<pid>.<n>.tmp   a write in progress

``<aa>`` is the first byte of the key's hash, so no directory holds more than ~1/256 of the files.
A block file appears under its final name only complete: it is written into a spare file and
published by ``renameat2(RENAME_NOREPLACE)`` (:mod:`~kvoffload.tiers.disk.spares`), or under a
temporary name published with :func:`os.link`; both fail when the name exists, so two processes
writing the same block never replace or mix each other's file (the second drops its copy).

The shared byte count is :mod:`~kvoffload.tiers.disk.ledger`'s; finding files is
:mod:`~kvoffload.tiers.disk.scan`'s. Every function here runs on the tier's I/O threads, never on
the scheduler thread.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.blockformat import (
    HEADER_ALIGN,
    BlockHeader,
    CorruptBlockError,
    encode_header,
    header_size,
    parse_header,
    payload_checksum,
    verify_payload,
)
from kvoffload.tiers.disk.spares import publish

if TYPE_CHECKING:
    from kvoffload.tiers.codec import BlockCodec

__all__ = [
    "MAX_KEY_BYTES",
    "SUFFIX",
    "TMP_SUFFIX",
    "BlockFiles",
    "FaultHook",
    "TemporaryRemovedError",
    "file_bytes",
    "is_no_space",
]

SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_DISK_BLOCK = 4096
#: Numbers temporary files, unique within the process (``next`` is atomic): with the pid in the
#: name, no two writers (threads or tiers) ever share a temporary file.
_TMP_IDS = itertools.count()
#: The fault hook: called as ``hook(op, key)`` before each block's I/O (``op`` is ``"write"`` or
#: ``"read"``); raising ``OSError`` makes that block's I/O fail exactly as the OS would.
FaultHook = Callable[[str, OffloadKey], None]


#: Keys up to this many bytes fit the one-page header every block file has.
MAX_KEY_BYTES = HEADER_ALIGN - header_size(0, 1)


class TemporaryRemovedError(KVOffloadError, FileNotFoundError):
    """A write's temporary file vanished before it was published: a scan found it older than
    the stale age and removed it, returning its reservation to the ledger (the writer must not)."""


def file_bytes(block_bytes: int) -> int:
    """Bytes one block file occupies on disk: a 4 KiB header + the payload in whole 4 KiB blocks."""
    return HEADER_ALIGN + -(-block_bytes // _DISK_BLOCK) * _DISK_BLOCK


class BlockFiles:
    """Reads and writes block files of one namespace (see the module docstring).

    ``pool`` is the host pool as a flat byte view; slot ``s`` is ``pool[s*B:(s+1)*B]`` with
    ``B = block_bytes``. Payloads move between the pool and the files with ``os.preadv`` /
    ``os.pwritev``: no copy in Python. ``o_direct`` opens files with ``O_DIRECT`` (the pool and
    the block size must be 4 KiB aligned; the tier checks).
    """

    def __init__(
        self,
        namespace: Path,
        fingerprint: bytes,
        pool: memoryview,
        block_bytes: int,
        o_direct: bool = False,
        fault_hook: FaultHook | None = None,
        codec: BlockCodec | None = None,
    ) -> None:
        if codec is not None and o_direct:
            raise ConfigError("kv_disk_compression", "compressed block files need O_DIRECT off")
        self.codec = codec
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.pool = pool
        self.block_bytes = block_bytes
        self.o_direct = o_direct
        self.fault_hook = fault_hook
        self._flags = getattr(os, "O_DIRECT", 0) if o_direct else 0
        self._prefix = f"{namespace}/"  # paths are built as strings: pathlib is slow per block

    def path_of(self, key: OffloadKey) -> str:
        name = key.hex()
        return f"{self._prefix}{name[:2]}/{name}{SUFFIX}"

    def slot(self, slot: int) -> memoryview:
        """The bytes of host slot ``slot``."""
        b = self.block_bytes
        return self.pool[slot * b : (slot + 1) * b]

    def header_buffer(self) -> bytearray | mmap.mmap:
        """A buffer for one block header, to pass to every :meth:`read` of one thread (page
        aligned with O_DIRECT; the caller closes it then)."""
        return mmap.mmap(-1, HEADER_ALIGN) if self.o_direct else bytearray(HEADER_ALIGN)

    def write(
        self, key: OffloadKey, slot: int, spare: str | None = None, frame: bytes | None = None
    ) -> bool:
        """Write slot ``slot`` as the block of ``key``; True if this call published the file,
        False if the file already existed (written by someone else: equal bytes by construction).
        ``frame``: the slot encoded by the codec, written instead (an encoded header).

        ``spare``: a file made ahead (:mod:`~kvoffload.tiers.disk.spares`) to write into and
        publish by rename; without one (or if it vanished) a temporary file is created and
        published by ``link``. Either way the written file is gone afterwards unless published.
        Raises ``OSError`` on I/O errors: :class:`TemporaryRemovedError` when a scan took the
        file for a killed writer's and removed it (with its reservation).
        """
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"keys of {len(key)} bytes do not fit a block header")
        if self.fault_hook is not None:
            self.fault_hook("write", key)
        payload = self.slot(slot) if frame is None else memoryview(frame)
        header = encode_header(
            self.fingerprint,
            key,
            len(payload),
            payload_checksum(payload),
            encoded=frame is not None,
        )
        name = key.hex()
        folder = self._prefix + name[:2]
        final = f"{folder}/{name}{SUFFIX}"
        fd = self._open_spare(spare) if spare is not None else -1
        if fd < 0:
            spare = None
            path = f"{folder}/.{name}.{os.getpid()}.{next(_TMP_IDS)}{TMP_SUFFIX}"
            fd = self._open_new(path, folder)
        else:
            path = spare  # type: ignore[assignment]
        published = False
        try:
            self._write_all(fd, header, payload, truncate=spare is not None)
            published = self._publish(path, final, folder, by_rename=spare is not None)
            return published
        finally:
            if not (published and spare is not None):  # a renamed spare has no old name left
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _open_spare(self, spare: str) -> int:
        """The spare opened for writing, or -1 if it is gone."""
        try:
            return os.open(spare, os.O_WRONLY | self._flags)
        except FileNotFoundError:
            return -1

    def _write_all(self, fd: int, header: bytes, payload: memoryview, truncate: bool) -> None:
        """Header and payload at offset 0 (``truncate``: cut what a recycled file had beyond
        them); closes ``fd``."""
        iov: list[memoryview | bytes | mmap.mmap] = [header, payload]
        head_buf = None
        if self.o_direct:
            head_buf = mmap.mmap(-1, len(header))
            head_buf[:] = header
            iov = [head_buf, payload]
        try:
            total = len(header) + len(payload)
            written = os.pwritev(fd, iov, 0)
            while written < total:  # rare short write: finish it
                written += os.pwrite(fd, _tail(iov, written), written)
            if truncate:
                os.ftruncate(fd, total)
        finally:
            os.close(fd)
            if head_buf is not None:
                head_buf.close()

    def _publish(self, path: str, final: str, folder: str, by_rename: bool) -> bool:
        """``path`` under its block's name; False if that name exists (``path`` is left)."""
        try:
            try:
                (publish if by_rename else os.link)(path, final)
            except FileNotFoundError:
                if not by_rename or os.path.isdir(folder):
                    raise
                os.makedirs(folder, exist_ok=True)  # its hash directory is not there yet
                publish(path, final)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError as exc:
            raise TemporaryRemovedError(exc.errno, f"{path} was removed while written") from exc

    def _open_new(self, tmp: str, folder: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags
        try:
            return os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # its hash directory is not there yet
            os.makedirs(folder, exist_ok=True)
            return os.open(tmp, flags, 0o644)

    def scratch_buffer(self) -> bytearray | None:
        """With a codec, a buffer for one stored payload, to pass to every :meth:`read` of one
        thread; ``None`` without (payloads are read straight into their slots)."""
        return None if self.codec is None else bytearray(self.block_bytes)

    def read(
        self,
        key: OffloadKey,
        slot: int,
        head_buf: bytearray | mmap.mmap | None = None,
        scratch: bytearray | None = None,
    ) -> None:
        """Read the block of ``key`` into slot ``slot``, verified; ``head_buf`` (from
        :meth:`header_buffer`, reused across calls) receives the header. With a codec the
        payload is read into ``scratch`` (:meth:`scratch_buffer`), its checksum checked, then
        decoded (or, stored raw, copied) into the slot, on the calling (I/O) thread.

        Raises :class:`CorruptBlockError` (``corrupt``/``layout``/``checksum``),
        ``FileNotFoundError`` (missing) or ``OSError``. On failure the slot holds garbage.
        """
        if self.fault_hook is not None:
            self.fault_hook("read", key)
        slot_view = self.slot(slot)
        if self.codec is not None and scratch is None:
            scratch = bytearray(self.block_bytes)
        payload = slot_view if scratch is None else memoryview(scratch)
        head_len = header_size(len(key))
        buf: bytearray | mmap.mmap
        if head_buf is not None and len(head_buf) == head_len:
            buf, own = head_buf, False
        else:
            buf = mmap.mmap(-1, head_len) if self.o_direct else bytearray(head_len)
            own = True
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY | self._flags)
            try:
                got = os.preadv(fd, [buf, payload], 0)
            finally:
                os.close(fd)
            if got < head_len:
                raise CorruptBlockError("corrupt", f"file is {got} bytes, shorter than its header")
            header = parse_header(buf, self.fingerprint, key, HEADER_ALIGN)
        finally:
            if own and isinstance(buf, mmap.mmap):
                buf.close()
        if scratch is not None:
            self._finish_stored(header, payload[: max(0, got - head_len)], slot_view)
            return
        if (
            header.encoded
            or got - head_len != header.payload_len
            or header.payload_len != len(payload)
        ):
            raise CorruptBlockError(
                "corrupt",
                f"payload is {got - head_len} bytes, expected {header.payload_len} "
                f"(slot {len(payload)})",
            )
        verify_payload(header, payload)

    def _finish_stored(self, header: BlockHeader, stored: memoryview, slot: memoryview) -> None:
        """A payload read beside its slot: verified, then decoded (or copied) into ``slot``."""
        if len(stored) != header.payload_len or (
            not header.encoded and header.payload_len != len(slot)
        ):
            raise CorruptBlockError(
                "corrupt", f"payload is {len(stored)} bytes, header says {header.payload_len}"
            )
        verify_payload(header, stored)
        if not header.encoded:
            slot[:] = stored
        elif self.codec is None:
            raise CorruptBlockError("corrupt", "an encoded block in a tier without a codec")
        else:
            self.codec.decode(stored, slot)


def _tail(iov: list, offset: int) -> bytes:
    """The bytes of the concatenated buffers ``iov`` from ``offset`` on (short-write recovery)."""
    joined = b"".join(bytes(b) for b in iov)
    return joined[offset:]


def is_no_space(exc: OSError) -> bool:
    """The filesystem (or the user's quota) is full."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
