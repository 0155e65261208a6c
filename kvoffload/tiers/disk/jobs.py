"""The disk tier's I/O threads: store and load jobs, block by block, reported once each.

The scheduler thread decides (what to store, which victims go, what to load) and hands a job to
:class:`DiskJobRunner`; the runner moves the bytes on its threads and queues the job in
:attr:`DiskJobRunner.done` after its last block, for the scheduler thread's next poll.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from kvoffload.keys import OffloadKey
from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.contract import ResultSignal, TierJob
from kvoffload.tiers.disk.directory import free_bytes
from kvoffload.tiers.disk.files import BlockFiles, TemporaryRemovedError, file_bytes, is_no_space
from kvoffload.tiers.disk.ledger import MEASURE, SpaceLedger
from kvoffload.tiers.disk.spares import SparePool

if TYPE_CHECKING:
    from kvoffload.tiers.codec import BlockCodec

__all__ = ["DiskJobRunner", "RunningJob"]

logger = logging.getLogger(__name__)

#: ``(key, host slot)`` pairs of one job.
Items = list[tuple[OffloadKey, int]]
#: ``(key, host slot, spare file or None, encoded frame or None, file bytes)`` of a store's
#: blocks that fit.
Writes = list[tuple[OffloadKey, int, str | None, bytes | None, int]]
_T = TypeVar("_T")


class RunningJob:
    """A submitted job until its last block finished (I/O threads update it under ``lock``)."""

    __slots__ = (
        "failed",
        "filesystem_full",
        "is_store",
        "job",
        "lock",
        "nbytes",
        "pinned",
        "remaining",
        "reserved",
        "sizes",
        "start",
    )

    def __init__(self, job: TierJob, is_store: bool, remaining: int) -> None:
        self.job = job
        self.is_store = is_store
        self.failed: dict[OffloadKey, str] = {}
        self.remaining = remaining
        self.nbytes = 0
        self.pinned: list[OffloadKey] = []  # a load's keys pinned in the index
        self.reserved = 0  # a store's net bytes, counted by the tier until the job is reported
        self.filesystem_full = False  # a store's write met ENOSPC / EDQUOT
        self.sizes: dict[OffloadKey, int] = {}  # a compressed store's file bytes per written key
        self.start = time.perf_counter()
        self.lock = threading.Lock()


class DiskJobRunner:
    """Runs a disk tier's jobs on ``num_threads`` I/O threads.

    A store first unlinks its victims and reserves the bytes of all its blocks in one ledger
    step, before any block is written (so no block of the job can find the directory full for
    lack of the room its own victims free); the blocks that fit are then written over the
    threads, and the blocks that do not (other processes took the room) fail ``"full"``: the job
    keeps its longest prefix. Stores take their ledger steps in the order they were submitted, so
    a victim's file is gone before a later store writes the same key again. A write that finds
    the filesystem full (before the tier's bound) fails ``"full"`` and lowers the ledger's limit
    to what the filesystem holds (:meth:`SpaceLedger.refit`), so later stores evict instead;
    that is logged once per runner, not per block. A load's blocks are split over the threads.
    Every job lands in :attr:`done` exactly once, and :attr:`result_signal` is notified then;
    :meth:`drain` waits for all of them.

    With ``spares``, writes go into files made ahead (``diskspares``): the victims' own files,
    recycled by the ledger step while this process is alone on the directory, then empty files
    the pool made while idle; the pool is refilled whenever the runner falls idle.

    With ``codec`` (a compressed tier) files differ in size: a store encodes its blocks first (on
    its I/O thread, before its turn), reserves each file's own bytes
    (:meth:`SpaceLedger.reserve_files`; victims counted by their measured size, never recycled),
    and records each written file's bytes in :attr:`RunningJob.sizes`; loads decode on the I/O
    threads.
    """

    def __init__(
        self,
        files: BlockFiles,
        ledger: SpaceLedger,
        file_bytes: int,
        num_threads: int,
        spares: SparePool | None = None,
        codec: BlockCodec | None = None,
        result_signal: ResultSignal | None = None,
    ) -> None:
        #: Notified whenever a job lands in :attr:`done` (the tier's, replaced with it).
        self.result_signal = ResultSignal() if result_signal is None else result_signal
        self._files = files
        self._codec = codec
        self._spares = spares
        self._closing = False
        self._ledger = ledger
        self._file_bytes = file_bytes
        self._num_threads = max(1, num_threads)
        self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="kvoffload-disk")
        self._inflight = 0
        self._idle = threading.Condition()
        self._refill: Future[None] | None = None  # the spare pool's refill in progress
        # Store tickets: the scheduler thread numbers stores; a store's ledger step waits until
        # every earlier store's step is done (its turn).
        self._tickets = 0
        self._turn = 0
        self._turns = threading.Condition()
        self._full_logged = False
        #: Finished jobs, appended by any thread, popped by the scheduler thread.
        self.done: collections.deque[RunningJob] = collections.deque()
        #: A load found a block file missing (another process evicted it, or it was removed
        #: by hand): the ledger's reconciliation is due. Set by I/O threads, reset by it.
        self.missing_files = False

    @property
    def _removed_bytes(self) -> int:
        """What a removed block file is counted as: the fixed size, or measured (compressed)."""
        return self._file_bytes if self._codec is None else MEASURE

    # ------------------------------------------------------------------ scheduler thread

    def store(self, running: RunningJob, items: Items, victims: list[OffloadKey]) -> None:
        """Write ``items`` after unlinking ``victims`` (already out of the index)."""
        self._started()
        ticket, self._tickets = self._tickets, self._tickets + 1
        self._pool.submit(self._store_job, running, items, victims, ticket)

    def load(self, running: RunningJob, items: Items) -> None:
        """Read ``items`` (pinned in the index by the caller), verified."""
        self._started()
        for chunk in self._chunks(items):
            self._pool.submit(self._load_blocks, running, chunk)

    def finish(self, running: RunningJob) -> None:
        """Report a job that needs no I/O at the next poll."""
        self.done.append(running)
        self.result_signal.notify()

    def drain(self) -> None:
        """Block until every submitted job is in :attr:`done` (and the spare files it left to
        make are made: what follows a drain does not depend on thread timing)."""
        with self._idle:
            while self._inflight:
                self._idle.wait()
            refill = self._refill
        if refill is not None and refill.exception() is not None:  # waits for it
            logger.error("disk tier: making spare files failed", exc_info=refill.exception())

    def close(self) -> None:
        """Finish every job, then stop the threads."""
        self._closing = True  # no more refills
        self.drain()
        self._pool.shutdown(wait=True)

    @property
    def idle(self) -> bool:
        """No job is in flight (advisory: read without the lock)."""
        return not self._inflight

    def _started(self) -> None:
        with self._idle:
            self._inflight += 1

    def _chunks(self, items: list[_T]) -> list[list[_T]]:
        """``items`` split into one run of consecutive blocks per I/O thread."""
        size = max(1, -(-len(items) // self._num_threads))
        return [items[i : i + size] for i in range(0, len(items), size)]

    # ------------------------------------------------------------------ I/O threads

    def _store_job(
        self, running: RunningJob, items: Items, victims: list[OffloadKey], ticket: int
    ) -> None:
        """A store's first step, in its turn: the victims go and every block's bytes are
        reserved in one ledger step; then the blocks that fit are written over the threads.
        (Earlier stores' steps were queued first, so they are running or done: no deadlock.)"""
        path_of, spares, codec = self._files.path_of, self._spares, self._codec
        frames: list[bytes | None] = [None] * len(items)
        sizes = [self._file_bytes] * len(items)
        if codec is not None:  # before the turn: stores encode in parallel
            frames, sizes = self._encode(items)
        with self._turns:
            while self._turn != ticket:
                self._turns.wait()
        try:
            if codec is None:
                fit, recycled = self._ledger.reserve_blocks(
                    len(items),
                    self._file_bytes,
                    [path_of(k) for k in victims],
                    spares.new_name if spares is not None else None,
                )
            else:
                fit = self._ledger.reserve_files(sizes, [path_of(k) for k in victims])
                recycled = []
        except Exception as exc:  # never lose a job: its blocks fail (the ledger keeps the victims)
            logger.exception("disk tier: reserving %d blocks failed: %s", len(items), exc)
            self._chunk_done(running, len(items), dict.fromkeys((k for k, _ in items), "io"), 0)
            return
        finally:
            with self._turns:
                self._turn += 1
                self._turns.notify_all()
        if fit < len(items):
            full = dict.fromkeys((k for k, _ in items[fit:]), "full")
            self._chunk_done(running, len(items) - fit, full, 0)
        if not fit:
            return
        files = recycled + [
            spares.take() if spares is not None else None for _ in range(fit - len(recycled))
        ]
        writes = [
            (key, slot, spare, frame, size)
            for (key, slot), spare, frame, size in zip(items, files, frames, sizes, strict=False)
        ]
        first, *rest = self._chunks(writes)
        for chunk in rest:
            self._pool.submit(self._store_blocks, running, chunk)
        self._store_blocks(running, first)

    def _encode(self, items: Items) -> tuple[list[bytes | None], list[int]]:
        """The frames of a store's blocks (``None``: stored as they are) and their file bytes.
        Encoding failures are logged once for the store, counted, with the first's traceback."""
        codec, files = self._codec, self._files
        frames: list[bytes | None] = []
        sizes: list[int] = []
        failures = 0
        first: BaseException | None = None
        for _, slot in items:
            frame = None
            if codec is not None:
                try:
                    frame = codec.encode(files.slot(slot))
                except Exception as exc:  # never lose a block: it is stored as it is
                    failures += 1
                    first = first or exc
            frames.append(frame)
            sizes.append(self._file_bytes if frame is None else file_bytes(len(frame)))
        if first is not None:
            logger.error("disk tier: encoding %d of %d blocks failed; stored raw: %s",
                         failures, len(items), first, exc_info=first)
        return frames, sizes

    def _store_blocks(self, running: RunningJob, items: Writes) -> None:
        """Write blocks whose bytes :meth:`_store_job` reserved; return the unused bytes (failed
        writes, blocks another process published first) in one ledger step."""
        write, block_bytes = self._files.write, self._files.block_bytes
        failed: dict[OffloadKey, str] = {}
        sizes: dict[OffloadKey, int] = {}
        nbytes = unused = 0
        error: BaseException | None = None  # the first, logged once for the chunk
        no_space = False
        started = time.perf_counter()
        for key, slot, spare, frame, size in items:
            try:
                published = (
                    write(key, slot, spare) if frame is None else write(key, slot, spare, frame)
                )
                if not published:
                    unused += size  # another process published it (the same bytes: same size)
                sizes[key] = size
                nbytes += block_bytes
            except TemporaryRemovedError as exc:  # the scan that removed it returned its bytes
                failed[key], error = "io", error or exc
            except OSError as exc:
                unused += size
                if is_no_space(exc):
                    failed[key] = "full"
                    no_space = running.filesystem_full = True
                else:
                    failed[key], error = "io", error or exc
            except Exception as exc:  # never lose a job: report it failed
                unused += size
                failed[key], error = "io", error or exc
        if error is not None:
            logger.warning("disk tier: storing %d blocks failed: %s", len(failed), error)
        settled = sum(item[4] for item in items)
        if self._codec is not None:
            self._codec.note_io(settled, time.perf_counter() - started)
        try:  # the chunk's writes are over: no longer in flight, and unused bytes go back
            self._ledger.release(unused, settled=settled)
        except Exception:  # the count drifts high (conservative) until a reconciliation
            logger.exception("disk tier: returning %d bytes to the ledger failed", unused)
        if no_space:
            self._fit_filesystem()
        with running.lock:
            running.sizes.update(sizes)
        self._chunk_done(running, len(items), failed, nbytes)

    def _fit_filesystem(self) -> None:
        """A write met a full filesystem: lower the ledger's limit to what it holds."""
        fb, namespace = self._file_bytes, self._files.namespace
        try:
            limit = self._ledger.refit(lambda: free_bytes(namespace), fb)
        except Exception:
            logger.exception("disk tier: measuring the full filesystem of %s failed", namespace)
            return
        log = logger.debug if self._full_logged else logger.warning
        self._full_logged = True
        log(
            "disk tier: the filesystem of %s is full before the tier's bound: the tier now holds "
            "at most %d blocks (%.1f MiB; bound %d blocks) and evicts to make room "
            "(logged once; it grows back when space is freed)",
            namespace,
            limit // fb,
            limit / 2**20,
            self._ledger.capacity // fb,
        )

    def _load_blocks(self, running: RunningJob, items: Items) -> None:
        files = self._files
        read, head_buf, scratch = files.read, files.header_buffer(), files.scratch_buffer()
        failed: dict[OffloadKey, str] = {}
        nbytes = 0
        for key, slot in items:
            try:
                read(key, slot, head_buf, scratch)
                nbytes += files.block_bytes
            except FileNotFoundError:
                failed[key] = "missing"
                self.missing_files = True
            except CorruptBlockError as exc:
                failed[key] = exc.cause
                logger.warning("disk tier: dropping bad block file %s: %s", key.hex()[:16], exc)
                with contextlib.suppress(OSError):
                    self._ledger.remove(files.path_of(key), self._removed_bytes)
            except OSError as exc:
                failed[key] = "io"
                logger.warning("disk tier: loading %s failed: %s", key.hex()[:16], exc)
            except Exception as exc:
                failed[key] = "io"
                logger.exception("disk tier: loading %s failed: %s", key.hex()[:16], exc)
        if isinstance(head_buf, mmap.mmap):
            head_buf.close()
        self._chunk_done(running, len(items), failed, nbytes)

    def _chunk_done(
        self, running: RunningJob, n: int, failed: dict[OffloadKey, str], nbytes: int
    ) -> None:
        with running.lock:
            running.failed.update(failed)
            running.nbytes += nbytes
            running.remaining -= n
            last = running.remaining == 0
        if last:
            self.done.append(running)
            self.result_signal.notify()
            spares = self._spares
            with self._idle:
                self._inflight -= 1
                # Submitted before drain() can return, so close() never meets a shut executor;
                # the refill stops as soon as a job (or close) comes.
                if not self._inflight and spares is not None and spares.needs_refill():
                    self._refill = self._pool.submit(spares.refill, self._busy)
                self._idle.notify_all()

    def _busy(self) -> bool:
        return bool(self._inflight) or self._closing
