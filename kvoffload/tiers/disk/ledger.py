"""The disk tier's shared space ledger: the bytes of one namespace's block files, counted by every
process that uses the namespace, under a file lock.

::

    <namespace>/ledger   the count, a change counter and one slot per user (little-endian),
                         changed only under an exclusive flock
    <namespace>/users    every user holds a shared flock on it for its lifetime, and an OFD
                         lock on byte 0 (shared) and on the byte of its slot (exclusive)

A writer reserves a file's bytes before it writes the file; an evictor returns them only when its
own ``unlink`` removed the file. Every function here runs on the tier's I/O threads or at start,
never on the scheduler thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.errors import ContractError

__all__ = ["MAX_OWNERS", "MEASURE", "Census", "SpaceLedger", "measured_bytes"]

logger = logging.getLogger(__name__)

#: The ledger file: the count, then the change counter (bumped by every step).
_HEAD = struct.Struct("<QQ")
#: One slot per user after the head: its owner token (0: free) and its bytes in flight.
_SLOT = struct.Struct("<QQ")
#: Users tracked by a slot; a user beyond them is "untracked" and holds byte ``1 + MAX_OWNERS``.
MAX_OWNERS = 128
_UNTRACKED_BYTE = 1 + MAX_OWNERS
#: As the bytes of a file to remove: the file's own size, read before it is unlinked (compressed
#: tiers, whose block files differ in size). A file replaced between the ``stat`` and the
#: ``unlink`` makes the count drift until the next reconciliation, never past the bound for long.
MEASURE = -1
_DISK_BLOCK = 4096


def measured_bytes(st_size: int) -> int:
    """The bytes a file of ``st_size`` bytes is counted as: whole 4 KiB blocks."""
    return -(-st_size // _DISK_BLOCK) * _DISK_BLOCK


@dataclass(frozen=True, slots=True)
class Census:
    """Who uses the namespace, read in one locked step (:meth:`SpaceLedger.census`).

    ``quiescent``: every live user is tracked by a slot and has no bytes in flight (no
    reservation whose file is yet to be published or returned), so the block files alone are
    what the count must be. ``live_owners``: the live users' owner names (spare-file prefixes);
    ``dead_slots``: slots whose user is gone (their spares and temporaries are garbage)."""

    generation: int
    quiescent: bool
    live_owners: frozenset[str]
    dead_slots: tuple[int, ...]


class SpaceLedger:
    """The bytes of block files in one namespace, shared by every process using it.

    The count opens the ledger file; every change happens under an exclusive ``flock`` of that
    file, so processes never both take the last free bytes. A writer reserves a file's bytes
    before writing it and returns them if the write fails; an evictor returns a file's bytes only
    when its own ``unlink`` succeeded (``ENOENT``: another process already removed and counted it).

    Every process using the namespace holds a shared ``flock`` on a second file (``users``) for
    its lifetime, taken before anything reads the namespace (:meth:`join`); a process that gets it
    exclusively at start knows no other process is using the directory, so it may reset the count
    from a scan. Locks die with their
    process (also on SIGKILL), so a killed process never blocks that.

    Every user also holds an OFD read lock on the ``users`` file, so a process can ask at any
    time whether it is alone (:meth:`alone`) without giving up its own lock.

    Invariant: with no write in flight, the count (:meth:`read`) equals the bytes of the
    namespace's block files, whatever failed. A step that fails after it unlinked files remembers
    the bytes it freed and settles them at the next step; victims a failed step did not reach are
    unlinked by the next one.

    Convergence: a process killed between a reservation and its files' publication leaves
    bytes counted for files that never appear, and files removed by hand stay counted. Every
    user therefore owns a *slot* in the ledger file (an owner token and its bytes in flight),
    held alive by an OFD lock on the slot's byte of ``users`` (it dies with the process). Any
    user may :meth:`census` the slots and, when every live user has nothing in flight, count
    the block files (unlocked) and :meth:`settle_census`: set the count to them, remove the
    garbage (temporaries, spares with bytes, dead users' spares) and free dead users' slots,
    unless a step of any process changed the ledger meanwhile (the change counter).

    ``capacity`` is the configured bound; :attr:`limit` is what reservations may reach: the bound,
    or less after the filesystem filled first (:meth:`refit`).
    """

    def __init__(self, path: Path, capacity: int) -> None:
        self.capacity = capacity
        #: The bound reservations respect now (read by the scheduler thread without the lock).
        self.limit = capacity
        #: The count after the latest change made through this ledger.
        self.last_seen = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        # flock excludes other processes only: threads sharing the descriptor need this too.
        self._thread_lock = threading.Lock()
        self._users_path = path.with_name("users")
        self._users_fd = os.open(self._users_path, os.O_RDWR | os.O_CREAT, 0o644)
        # Guarded by _thread_lock: victims (path, bytes) a step has yet to unlink, and the bytes
        # by which the count file is off after a failed write (added at the next step).
        self._owed: list[tuple[str, int]] = []
        self._unsettled = 0
        self._ofd_lock = _ofd_lock(self._users_fd, fcntl.F_RDLCK, fcntl.F_OFD_SETLK)
        # Bytes this process reserved whose files are not yet published or returned (guarded
        # by _thread_lock), and what its slot in the file says.
        self._inflight = 0
        self._slot_inflight = 0
        self._token = 0
        self._slot = self._take_slot() if self._ofd_lock else None
        #: This user's name for its spare files (its slot's token, or untracked: pid and id).
        self.owner = (
            f"{self._token:016x}" if self._slot is not None else f"{os.getpid()}-{id(self):x}"
        )

    def _take_slot(self) -> int | None:
        """A free slot (its user gone, or never used) with a new token, or None (then this
        user holds the untracked byte: nobody reconciles while it lives)."""
        self._token = int.from_bytes(os.urandom(8), "little") | 1
        with self._locked():
            for slot in range(MAX_OWNERS):
                if _ofd_lock(self._users_fd, fcntl.F_WRLCK, fcntl.F_OFD_SETLK, 1 + slot):
                    count, generation = self._head()
                    os.pwrite(self._fd, _SLOT.pack(self._token, 0), _HEAD.size + slot * _SLOT.size)
                    os.pwrite(self._fd, _HEAD.pack(count, generation + 1), 0)
                    return slot
        _ofd_lock(self._users_fd, fcntl.F_RDLCK, fcntl.F_OFD_SETLK, _UNTRACKED_BYTE)
        return None

    def alone(self) -> bool:
        """No other process uses the namespace now (False where OFD locks do not work). One
        ``fcntl`` call; a process that starts later finds this one."""
        if not self._ofd_lock:
            return False
        try:
            return _ofd_lock(self._users_fd, fcntl.F_WRLCK, fcntl.F_OFD_GETLK, query=True)
        except OSError:
            return False

    def claim_alone(self) -> bool:
        """Try to become the namespace's only user (exclusive, non-blocking); see :meth:`share`."""
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def join(self) -> bool | None:
        """Hold the users lock: exclusive when no other process holds it (True: alone, until
        :meth:`share`), else shared (False; waits while a reclaim holds it). ``None`` when the
        namespace was reclaimed before the lock was taken (its ``users`` is no longer the file
        locked, :mod:`~kvoffload.tiers.disk.reclaim`): close this ledger and make it again."""
        alone = self.claim_alone()
        if not alone:
            self.share()
        try:
            same = os.path.samestat(os.fstat(self._users_fd), os.stat(self._users_path))
        except FileNotFoundError:
            same = False
        return alone if same else None

    def share(self) -> None:
        """Hold the users lock shared from now on (other processes may start)."""
        fcntl.flock(self._users_fd, fcntl.LOCK_SH)

    def _locked(self) -> _LedgerLock:
        return _LedgerLock(self._fd, self._thread_lock)

    def read(self) -> int:
        """The count."""
        with self._locked():
            return self._get() + self._unsettled

    def snapshot(self, measure: Callable[[], int]) -> tuple[int, int]:
        """``(count, measure())`` with the ledger locked: no process changes files meanwhile."""
        with self._locked():
            return self._get() + self._unsettled, measure()

    def _get(self) -> int:
        return self._head()[0]

    def _head(self) -> tuple[int, int]:
        """``(count, change counter)``; a ledger of an older version has the count only."""
        raw = os.pread(self._fd, _HEAD.size, 0).ljust(_HEAD.size, b"\0")
        count, generation = _HEAD.unpack(raw)
        return count, generation

    def _begin(self) -> tuple[int, int]:
        """A step's start (ledger locked): ``(file value, true count)``, owed victims unlinked."""
        base = self._get()  # raises before anything changed: the victims stay owed
        return base, base + self._unsettled - self._unlink_owed()

    def _unlink_owed(self) -> int:
        """Unlink the owed victims; returns the bytes of the files this call removed."""
        owed, self._owed = self._owed, []
        freed = 0
        for path, nbytes in owed:
            try:
                freed += _unlink_counted(path, nbytes)
            except FileNotFoundError:
                pass  # another process removed (and counted) it
            except OSError as exc:  # it stays on disk, counted: the count stays true
                logger.warning("disk tier: cannot remove evicted block file %s: %s", path, exc)
        return freed

    def _commit(self, base: int, value: int, on_failure: int) -> None:
        """Write the count ``value``; if that fails, remember that the true count is
        ``on_failure`` (the step's file changes without its reservation) and re-raise."""
        try:
            generation = self._head()[1]
            os.pwrite(self._fd, _HEAD.pack(max(0, value), generation + 1), 0)
        except BaseException:
            self._unsettled = on_failure - base
            raise
        self._unsettled = 0
        self.last_seen = max(0, value)
        self._write_slot()

    def _write_slot(self) -> None:
        """This user's bytes in flight into its slot, when they changed (ledger locked; a
        failure is retried at the next step: only live users' slots are read)."""
        if self._slot is not None and self._slot_inflight != self._inflight:
            offset = _HEAD.size + self._slot * _SLOT.size
            try:
                os.pwrite(self._fd, _SLOT.pack(self._token, self._inflight), offset)
            except OSError as exc:  # the count is written: this step stands
                logger.warning("disk tier: cannot update this process's ledger slot: %s", exc)
                return
            self._slot_inflight = self._inflight

    def reserve_blocks(
        self,
        count: int,
        block_bytes: int,
        victims: Sequence[str],
        spare_name: Callable[[], str] | None = None,
    ) -> tuple[int, list[str]]:
        """Remove ``victims`` (files of ``block_bytes``), then take the bytes of as many of
        ``count`` blocks as fit. One locked step for a whole job: atomic with respect to every
        other thread and process. Returns ``(fit, recycled)``.

        With ``spare_name`` (a new spare path per call), victims are recycled: renamed to
        spares and, if this process is :meth:`alone`, kept, their bytes counted for the job's
        first blocks (``recycled``, at most ``fit``, to write into); otherwise, and for those
        beyond ``fit``, unlinked as usual."""
        with self._thread_lock:
            self._owed.extend((path, block_bytes) for path in victims)
        with self._locked():
            base = self._get()  # raises before anything changed: the victims stay owed
            recycled = self._recycle_owed(spare_name) if spare_name is not None else []
            used = base + self._unsettled - self._unlink_owed()
            fit = max(0, min(count, len(recycled) + (self.limit - used) // block_bytes))
            for path in recycled[fit:]:
                used -= _unlink(path, block_bytes)
            del recycled[fit:]
            self._inflight += fit * block_bytes
            try:
                self._commit(base, used + (fit - len(recycled)) * block_bytes, used)
            except BaseException:
                self._inflight -= fit * block_bytes
                for path in recycled:
                    self._unsettled -= _unlink(path, block_bytes)
                raise
            return fit, recycled

    def reserve_files(self, sizes: Sequence[int], victims: Sequence[str]) -> int:
        """Remove ``victims`` (each counted as its own size, :data:`MEASURE`), then take the
        bytes of the longest prefix of files of ``sizes`` bytes that fits. One locked step, as
        :meth:`reserve_blocks` (for tiers whose files differ in size; no recycling). Returns how
        many fit."""
        with self._thread_lock:
            self._owed.extend((path, MEASURE) for path in victims)
        with self._locked():
            base = self._get()  # raises before anything changed: the victims stay owed
            used = base + self._unsettled - self._unlink_owed()
            room, fit, total = self.limit - used, 0, 0
            for size in sizes:
                if total + size > room:
                    break
                total += size
                fit += 1
            self._inflight += total
            try:
                self._commit(base, used + total, used)
            except BaseException:
                self._inflight -= total
                raise
            return fit

    def _recycle_owed(self, spare_name: Callable[[], str]) -> list[str]:
        """Rename the owed victims to spares; keep them if alone, else owe their unlinks."""
        renamed: list[tuple[str, int]] = []
        owed, self._owed = self._owed, []
        for path, nbytes in owed:
            spare = spare_name()
            try:
                os.rename(path, spare)
                renamed.append((spare, nbytes))
            except FileNotFoundError:
                pass  # another process removed (and counted) it
            except OSError:
                self._owed.append((path, nbytes))  # unlinked (or logged) as usual
        if renamed and not self.alone():
            self._owed.extend(renamed)  # a reader may hold one: unlink, never overwrite
            return []
        return [spare for spare, _ in renamed]

    def release(self, nbytes: int, settled: int = 0) -> int:
        """Return ``nbytes`` (a failed write, a duplicate, a dropped file); ``settled``: bytes
        of :meth:`reserve_blocks` whose writes are over (published or returned), no longer in
        flight. Returns the count (as last seen, when no step was needed: nothing returned and
        writes still in flight)."""
        with self._thread_lock:
            self._inflight -= settled  # true whatever the step does: the writes are over
            if not nbytes and self._inflight:  # the slot may overstate what is in flight for
                return self.last_seen  # now (conservative): it is written when it reaches 0
        with self._locked():
            base, used = self._begin()
            used -= nbytes
            self._commit(base, used, used)
            return max(0, used)

    def census(self) -> Census:
        """The slots, read under the lock: who is alive, and whether anyone has bytes in flight."""
        with self._locked():
            generation = self._head()[1]
            raw = os.pread(self._fd, MAX_OWNERS * _SLOT.size, _HEAD.size)
            quiescent = self._slot is not None and self._inflight == 0
            if quiescent and _held(self._users_fd, _UNTRACKED_BYTE):
                quiescent = False  # an untracked user's writes cannot be seen
            live, dead = {self.owner}, []
            for slot in range(len(raw) // _SLOT.size):
                token, inflight = _SLOT.unpack_from(raw, slot * _SLOT.size)
                if not token or slot == self._slot:
                    continue
                if _held(self._users_fd, 1 + slot):
                    live.add(f"{token:016x}")
                    quiescent = quiescent and inflight == 0
                else:
                    dead.append(slot)
            return Census(generation, quiescent, frozenset(live), tuple(dead))

    def settle_census(self, census: Census, nbytes: int, garbage: Sequence[str]) -> bool:
        """Set the count to ``nbytes`` (the block files a walk counted since ``census``),
        unlink ``garbage`` and free the dead slots, if no step changed the ledger since the
        census (else False: try again later). Only for a quiescent census."""
        if not census.quiescent:
            raise ContractError("settle_census needs a quiescent census (nothing in flight)")
        with self._locked():
            count, generation = self._head()
            if generation != census.generation:
                return False
            for path in garbage:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            for slot in census.dead_slots:
                os.pwrite(self._fd, _SLOT.pack(0, 0), _HEAD.size + slot * _SLOT.size)
            used = nbytes - self._unlink_owed()  # owed victims are block files the walk counted
            if used != count + self._unsettled:
                logger.info(
                    "disk tier: ledger reconciled with the files: %d bytes counted, %d on disk",
                    count + self._unsettled,
                    used,
                )
            self._commit(count, used, used)
            return True

    def remove(self, path: str, nbytes: int) -> int:
        """Unlink ``path`` and return its bytes (``nbytes``, or :data:`MEASURE`) if this call
        removed it; returns the count."""
        with self._locked():
            base, used = self._begin()
            with contextlib.suppress(FileNotFoundError):
                used -= _unlink_counted(path, nbytes)
            self._commit(base, used, used)
            return max(0, used)

    def reconcile(self, nbytes: int, alone: bool) -> int:
        """Set the count to ``nbytes`` (what a scan found) when this process is the only user;
        otherwise only raise it to that (others' reservations must stay). Returns the count."""
        with self._locked():
            base, used = self._begin()
            used = nbytes if alone else max(nbytes, used)
            self._commit(base, used, used)
            return used

    def refit(self, free_bytes: Callable[[], int], block_bytes: int) -> int:
        """Set :attr:`limit` to what the filesystem holds: the count plus ``free_bytes()`` (the
        filesystem's free space, read under the lock), in whole blocks of ``block_bytes``, at
        most :attr:`capacity`. Called when a write met a full filesystem (it lowers the limit)
        and while idle after that (it raises it again as space comes back). Returns the limit."""
        with self._locked():
            holds = self._get() + self._unsettled + free_bytes()
            self.limit = min(self.capacity, holds // block_bytes * block_bytes)
            return self.limit

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._users_fd)
            self._fd = self._users_fd = -1


def _unlink_counted(path: str, nbytes: int) -> int:
    """Unlink ``path``; its bytes: ``nbytes``, or its measured size (:data:`MEASURE`).
    ``FileNotFoundError`` when it is gone."""
    if nbytes == MEASURE:
        nbytes = measured_bytes(os.stat(path).st_size)
    os.unlink(path)
    return nbytes


def _unlink(path: str, nbytes: int) -> int:
    """``nbytes`` if this call removed ``path``, else 0."""
    try:
        os.unlink(path)
        return nbytes
    except FileNotFoundError:
        return 0


#: ``struct flock`` on Linux x86-64 / aarch64: type, whence, start, length, pid, padding.
_FLOCK = struct.Struct("hhqqi4x")


def _ofd_lock(fd: int, kind: int, command: int, start: int = 0, query: bool = False) -> bool:
    """An OFD lock ``command`` for byte ``start`` of ``fd``. Setting: True if taken (False where
    OFD locks do not work, or another holds it). ``query``: True if no other open file
    description holds a lock that conflicts with ``kind``."""
    arg = _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0)
    if query:
        return _FLOCK.unpack(fcntl.fcntl(fd, command, arg))[0] == fcntl.F_UNLCK
    try:
        fcntl.fcntl(fd, command, arg)
        return True
    except OSError:
        return False


def _held(fd: int, byte: int) -> bool:
    """Another open file description holds a lock on ``byte`` of ``fd`` (its user is alive)."""
    return not _ofd_lock(fd, fcntl.F_WRLCK, fcntl.F_OFD_GETLK, byte, query=True)


class _LedgerLock:
    """This process's threads (a mutex), then other processes (``flock``)."""

    __slots__ = ("_fd", "_lock")

    def __init__(self, fd: int, lock: threading.Lock) -> None:
        self._fd = fd
        self._lock = lock

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()
