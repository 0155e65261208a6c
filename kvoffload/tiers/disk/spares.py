"""Files made ahead of the disk tier's writes: creating a file is what a store pays most for when
other jobs write to the same filesystem (300-700 µs under load, against 3 µs to open one).

::

    <namespace>/spare/<owner>.<n>.spare   an empty file made while idle, or a victim's file

``<owner>`` is the ledger's name for the process (:attr:`SpaceLedger.owner
<kvoffload.tiers.disk.ledger.SpaceLedger.owner>`): the spares of a process that is gone are
removed by the next ledger reconciliation (or the next process that starts alone).

Two sources, one rule: no reader can hold a spare. A :class:`SparePool` creates empty spares
while the tier is idle; a store that evicts may *recycle* a victim's file into a spare instead
of unlinking it (its blocks are then overwritten, not allocated again), but only while no other
process uses the namespace: the victim is first renamed away (so nobody can open it by its name
any more), then :meth:`~kvoffload.tiers.disk.ledger.SpaceLedger.alone` is asked, and if another
process uses the directory the renamed file is unlinked as before (a reader that opened it in
time keeps reading it intact). Readers in this process never read a victim (the index never
evicts a block a load is reading).

A write into a spare publishes it with ``renameat2(RENAME_NOREPLACE)``: one metadata operation,
refused when the block's name exists (filesystems without the flag fall back to ``link`` +
``unlink``). A spare with bytes in it holds a reservation in the ledger; an empty one holds none.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["SPARE_DIR", "SPARE_SUFFIX", "SparePool", "publish"]

logger = logging.getLogger(__name__)

SPARE_DIR = "spare"
SPARE_SUFFIX = ".spare"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


class _Renamer:
    """``renameat2(RENAME_NOREPLACE)`` while the filesystem takes it, else ``link`` + ``unlink``."""

    def __init__(self) -> None:
        self._renameat2 = _renameat2

    def __call__(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``; ``FileExistsError`` (``src`` left) when ``dst`` exists."""
        renameat2 = self._renameat2
        if renameat2 is not None:
            src_b, dst_b = os.fsencode(src), os.fsencode(dst)
            if renameat2(_AT_FDCWD, src_b, _AT_FDCWD, dst_b, _RENAME_NOREPLACE) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise OSError(err, os.strerror(err), src, None, dst)
            self._renameat2 = None  # not on this filesystem: link + unlink from now on
        os.link(src, dst)
        os.unlink(src)


#: Publishes a written spare under its block's name (one per process: the fallback is learned once).
publish = _Renamer()


class SparePool:
    """Empty files for the next writes, made while the tier is idle (any thread may take one).

    ``target`` spares are kept; :meth:`refill` makes them one at a time and stops as soon as
    ``busy()`` says a job came. Names are unique to this pool (``owner``, a counter).
    :meth:`close` removes the spares left; those of a killed process are removed by the next
    ledger reconciliation, or the next process that finds itself alone on the directory
    (:func:`remove_all`).
    """

    def __init__(self, namespace: Path, target: int, o_direct: bool, owner: str) -> None:
        self.directory = str(namespace / SPARE_DIR)
        self.target = target
        self._flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if o_direct else 0)
        self._names = itertools.count()
        self._owner = owner
        self._spares: collections.deque[str] = collections.deque()
        os.makedirs(self.directory, exist_ok=True)

    def new_name(self) -> str:
        """A path in the spare directory no other spare has."""
        return f"{self.directory}/{self._owner}.{next(self._names)}{SPARE_SUFFIX}"

    def take(self) -> str | None:
        """An empty spare, or ``None`` when none is left."""
        try:
            return self._spares.popleft()
        except IndexError:
            return None

    def needs_refill(self) -> bool:
        return len(self._spares) < self.target

    def refill(self, busy: Callable[[], bool]) -> None:
        """Make spares up to the target, one at a time, until ``busy()``."""
        while len(self._spares) < self.target and not busy():
            path = self.new_name()
            try:
                os.close(os.open(path, self._flags, 0o644))
            except OSError as exc:  # a full filesystem, say: writes will create their files
                logger.debug("disk tier: cannot make a spare file: %s", exc)
                return
            self._spares.append(path)

    def close(self) -> None:
        """Remove the spares left."""
        while self._spares:
            with contextlib.suppress(OSError):
                os.unlink(self._spares.popleft())


def remove_all(namespace: Path) -> None:
    """Remove every spare (of processes that are gone: call only when alone on the directory)."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(namespace / SPARE_DIR):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
