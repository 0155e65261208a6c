"""Finding the disk tier's block files: one walk over a namespace's hash directories.

The warm start walks every hash directory once; the background rescan (:class:`Rescanner`) walks
only those whose mtime changed since they were last listed, and hands the names it had not seen
to the scheduler thread. The walk reads directory entries only, never a file. Temporary files
older than :data:`STALE_TMP_SECONDS` are leftovers of a killed writer and are deleted, their
reservations returned to the ledger; younger ones are writes in progress in other processes
(counted in :attr:`NamespaceScanner.fresh_temporaries`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.files import SUFFIX, TMP_SUFFIX
from kvoffload.tiers.disk.ledger import SpaceLedger, measured_bytes
from kvoffload.tiers.disk.spares import SPARE_DIR, SPARE_SUFFIX

__all__ = [
    "STALE_TMP_SECONDS",
    "NamespaceScanner",
    "Rescanner",
    "census_files",
    "count_file_bytes",
    "count_files",
]

logger = logging.getLogger(__name__)

#: Temporary files older than this (seconds) at a scan are leftovers of a killed writer.
STALE_TMP_SECONDS = 60.0


class NamespaceScanner:
    """Walks one namespace, remembering each hash directory's mtime and block-file names between
    walks. Used by one thread at a time (the warm start, then the rescan thread)."""

    def __init__(self, namespace: Path, ledger: SpaceLedger, file_bytes: int) -> None:
        self.namespace = namespace
        self._ledger = ledger
        self._file_bytes = file_bytes
        self._mtimes: dict[str, float] = {}
        self._names: dict[str, set[str]] = {}
        #: Temporary files younger than :data:`STALE_TMP_SECONDS` that the last walk saw.
        self.fresh_temporaries = 0

    def walk(self, changed_only: bool = False) -> Iterator[tuple[OffloadKey, str, bool]]:
        """``(key, path, new)`` of every block file in the hash directories: all of them, or
        (``changed_only``) those whose mtime changed since they were last listed. ``new``: no
        earlier walk listed the file. A directory's mtime is read before it is listed, so a
        change during the walk is listed again by the next one."""
        self.fresh_temporaries = 0
        now = time.time()
        try:
            subdirs = list(os.scandir(self.namespace))
        except FileNotFoundError:
            return
        for sub in subdirs:
            try:
                if not sub.is_dir(follow_symlinks=False):
                    continue
                mtime = sub.stat().st_mtime
            except FileNotFoundError:
                continue
            if changed_only and self._mtimes.get(sub.path) == mtime:
                continue
            self._mtimes[sub.path] = mtime
            seen = self._names.get(sub.path, set())
            names: set[str] = set()
            for key, name in self._list(sub.path, now):
                names.add(name)
                yield key, f"{sub.path}/{name}", name not in seen
            self._names[sub.path] = names

    def forget_mtimes(self) -> None:
        """List every directory at the next walk (an mtime may not tick within its resolution)."""
        self._mtimes.clear()

    def _list(self, path: str, now: float) -> Iterator[tuple[OffloadKey, str]]:
        """``(key, name)`` of the block files in one hash directory; handles temporaries."""
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.name
            if name.endswith(SUFFIX):
                try:
                    key = bytes.fromhex(name[: -len(SUFFIX)])
                except ValueError:
                    continue
                yield OffloadKey(key), name
            elif name.endswith(TMP_SUFFIX):
                try:
                    st = entry.stat(follow_symlinks=False)
                    if now - st.st_mtime <= STALE_TMP_SECONDS:
                        self.fresh_temporaries += 1
                    elif st.st_nlink > 1:  # a published block's second name: counted as the block
                        os.unlink(entry.path)
                    else:  # a killed writer's: its reservation goes with it
                        self._ledger.remove(entry.path, self._file_bytes)
                except FileNotFoundError:
                    pass
            elif name.endswith(SPARE_SUFFIX):  # empty ones hold no reservation: left to owners
                try:
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size and now - st.st_mtime > STALE_TMP_SECONDS:
                        self._ledger.remove(entry.path, self._file_bytes)
                except FileNotFoundError:
                    pass


def count_files(namespace: Path) -> int:
    """Files that hold a reservation: block files, temporary files and spares with bytes in
    them, each file once (a block being published has two names for an instant)."""
    inodes: set[int] = set()
    for sub in os.scandir(namespace):
        if sub.is_dir(follow_symlinks=False):
            for entry in os.scandir(sub.path):
                with contextlib.suppress(FileNotFoundError):
                    if entry.name.endswith((SUFFIX, TMP_SUFFIX)) or (
                        entry.name.endswith(SPARE_SUFFIX) and entry.stat().st_size
                    ):
                        inodes.add(entry.inode())
    return len(inodes)


def count_file_bytes(namespace: Path) -> int:
    """The bytes (:func:`~kvoffload.tiers.disk.ledger.measured_bytes`) of the files
    :func:`count_files` counts."""
    sizes: dict[int, int] = {}
    for sub in os.scandir(namespace):
        if sub.is_dir(follow_symlinks=False):
            for entry in os.scandir(sub.path):
                with contextlib.suppress(FileNotFoundError):
                    if entry.name.endswith((SUFFIX, TMP_SUFFIX, SPARE_SUFFIX)):
                        size = entry.stat(follow_symlinks=False).st_size
                        if size or not entry.name.endswith(SPARE_SUFFIX):
                            sizes[entry.inode()] = measured_bytes(size)
    return sum(sizes.values())


def census_files(
    namespace: Path, live_owners: frozenset[str], measure: bool = False
) -> tuple[int, list[str]]:
    """``(block files, garbage)`` of ``namespace`` while nothing is in flight (a quiescent
    :class:`~kvoffload.tiers.disk.ledger.Census`): then every temporary file is a killed
    writer's (or a published block's second name), and so is every spare with bytes; empty
    spares whose owner is not in ``live_owners`` belong to users that are gone. Reads
    directory entries only (one ``stat`` per spare). ``measure``: the first figure is the
    block files' bytes (:func:`~kvoffload.tiers.disk.ledger.measured_bytes`, one ``stat`` per
    file), for tiers whose files differ in size."""
    blocks, garbage = 0, []
    spare_dir = str(namespace / SPARE_DIR)
    for sub in os.scandir(namespace):
        if not sub.is_dir(follow_symlinks=False) or sub.path == spare_dir:
            continue
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(sub.path):
                if entry.name.endswith(SUFFIX):
                    if not measure:
                        blocks += 1
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        blocks += measured_bytes(entry.stat(follow_symlinks=False).st_size)
                elif entry.name.endswith(TMP_SUFFIX):
                    garbage.append(entry.path)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(spare_dir):
            if entry.name.split(".", 1)[0] not in live_owners:
                garbage.append(entry.path)
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_size:
                    garbage.append(entry.path)
    return blocks, garbage


class Rescanner:
    """Learns of block files other processes wrote: every ``interval`` seconds (0: never) a daemon
    thread walks the directories whose mtime changed and queues the keys it had not seen in
    :attr:`discovered`, for the scheduler thread to index at its next poll; then it calls
    ``on_tick`` (the tier's other periodic upkeep)."""

    def __init__(
        self, scanner: NamespaceScanner, interval: float, on_tick: Callable[[], None]
    ) -> None:
        self.scanner = scanner
        self._on_tick = on_tick
        #: Lists of new keys, appended by the rescan thread, popped by the scheduler thread.
        self.discovered: collections.deque[list[OffloadKey]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval > 0:
            self._thread = threading.Thread(
                target=self._loop, args=(interval,), name="kvoffload-disk-rescan", daemon=True
            )
            self._thread.start()

    def rescan_once(self, changed_only: bool = True) -> None:
        """One walk; its new keys are queued in :attr:`discovered`."""
        found = [key for key, _, new in self.scanner.walk(changed_only) if new]
        if found:
            self.discovered.append(found)

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.rescan_once()
                self._on_tick()
            except Exception:  # never let a transient filesystem error kill discovery
                logger.exception("disk tier: rescan failed")

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
