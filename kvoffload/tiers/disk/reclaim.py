"""Namespaces of an older format under the disk tier's root, removed once no process uses them.

The same goes for a tier's superseded namespaces: those its model's blocks had under another
``kv_disk_compression`` (raw files after a switch to a compressed tier, and the reverse). No
tier of the current setting reads them, and they are outside its bound, so they are removed
once no live process (one still running with the old setting) uses them.

An older kvoffload kept its namespaces under another format directory (:data:`OLD_FORMAT_DIRS`;
``kvoffload-v1`` named a model by its path, so no engine of today ever looks its blocks up).
Nothing else would ever remove them: each had its own bound and ledger. A namespace is removed
only when its ``users`` lock can be taken exclusively: every process that uses a namespace,
of that format too, holds it shared for its lifetime (locks die with their process), so a
namespace another live process reads is left alone and tried again later. The namespace is
first renamed out of the way (no process can open a file of it by its name from then on), then
deleted; a rename left behind by a process killed mid-way is deleted by the next reclaim. A
process starting on a namespace takes its lock before it reads anything there and checks that
the file it locked is still the namespace's (``directory.join_namespace``): one removed in the
meantime is made again, never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from kvoffload.tiers.disk.directory import FORMAT_DIR

__all__ = ["OLD_FORMAT_DIRS", "OldNamespaces", "remove_unused_namespace"]

logger = logging.getLogger(__name__)

#: Format directories of older kvoffload versions, under the tier's root.
OLD_FORMAT_DIRS = ("kvoffload-v1",)
#: The prefix of a namespace renamed for removal (inside its format directory).
_TRASH = ".reclaim."


class OldNamespaces:
    """The older formats' namespaces under ``root``, and the ``superseded`` namespaces (of the
    current format): :meth:`reclaim` removes those no process uses; ``in_use`` counts those it
    had to leave (tried again at the next :meth:`reclaim`)."""

    def __init__(self, root: Path, superseded: Sequence[Path] = ()) -> None:
        self._dirs = [root / name for name in OLD_FORMAT_DIRS]
        self._superseded = list(superseded)
        self._current = root / FORMAT_DIR
        self.in_use = 0
        #: Files removed so far (block files, ledgers, temporaries, spares).
        self.removed_files = 0

    def pending(self) -> bool:
        """Whether an older format's directory is still there (one ``stat`` per format)."""
        return any(d.exists() for d in self._dirs)

    def reclaim(self) -> None:
        """Remove every older-format namespace no process uses now (and the format directory
        once it is empty). Never raises: what cannot be removed now is left for next time."""
        in_use = removed = 0
        for format_dir in self._dirs:
            try:
                entries = list(os.scandir(format_dir))
            except OSError:  # absent (the usual case), or unreadable: nothing to do
                continue
            for entry in entries:
                try:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                if entry.name.startswith(_TRASH):
                    removed += _delete(Path(entry.path))
                    continue
                files = _remove_unused(Path(entry.path))
                if files is None:
                    in_use += 1
                else:
                    removed += files
            with contextlib.suppress(OSError):
                format_dir.rmdir()  # only once empty
        for namespace in self._superseded:
            if not namespace.exists():
                continue
            files = _remove_unused(namespace)
            if files is None:
                in_use += 1
            else:
                removed += files
        if self._superseded:
            removed += _delete_leftover_trash(self._current)
        if removed:
            logger.info(
                "disk tier: removed %d files of unused older-format or superseded namespaces",
                removed,
            )
        if in_use and in_use != self.in_use:
            logger.info(
                "disk tier: %d older-format or superseded namespaces are in use by other "
                "processes; they are removed once those end",
                in_use,
            )
        self.in_use = in_use
        self.removed_files += removed


def remove_unused_namespace(namespace: Path) -> int | None:
    """Delete ``namespace`` (a model's directory under the format directory) if no process uses
    it; the files removed, or ``None`` when a live process uses it (an operator's clear)."""
    return _remove_unused(namespace)


def _remove_unused(namespace: Path) -> int | None:
    """Delete ``namespace`` if no process uses it; the files removed, or None (in use, or its
    lock could not be taken)."""
    try:
        fd = os.open(namespace / "users", os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return 0  # another process removed it meanwhile
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # a live process uses it
        trash = namespace.with_name(f"{_TRASH}{namespace.name}.{os.getpid()}")
        try:
            os.rename(namespace, trash)
        except FileNotFoundError:
            return 0
        except OSError:
            return None
        return _delete(trash)
    finally:
        os.close(fd)


def _delete_leftover_trash(format_dir: Path) -> int:
    """Delete the renamed namespaces a process killed mid-removal left in ``format_dir``."""
    try:
        entries = [e for e in os.scandir(format_dir) if e.name.startswith(_TRASH)]
    except OSError:
        return 0
    return sum(_delete(Path(e.path)) for e in entries)


def _delete(tree: Path) -> int:
    """Delete ``tree`` (nobody opens its files by name any more); the files it held."""
    files = sum(len(names) for _, _, names in os.walk(tree))
    shutil.rmtree(tree, ignore_errors=True)
    return files
