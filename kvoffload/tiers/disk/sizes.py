"""The bytes of a compressed disk tier's block files: files differ in size, so the tier counts
each indexed block's file by its own bytes (:class:`FileSizes`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.ledger import measured_bytes

__all__ = ["MIN_FILE", "FileSizes", "files_that_fit", "measure_file"]

#: The smallest block file: its header page and one page of payload.
MIN_FILE = 8192


def measure_file(path: str) -> int:
    """A block file's counted bytes (0 if it vanished)."""
    try:
        return measured_bytes(os.stat(path).st_size)
    except FileNotFoundError:
        return 0


def files_that_fit(sizes: Sequence[int], room: int, budget: int) -> int:
    """How many of the first ``room`` files of ``sizes`` (bytes each) fit ``budget`` bytes."""
    for i, size in enumerate(sizes[:room]):
        budget -= size
        if budget < 0:
            return i
    return min(room, len(sizes))


class FileSizes:
    """The bytes of each indexed block's file (an estimate for other processes' files until one
    is measured) and their sum (:attr:`total`). Invariant: ``total`` is the sum of the recorded
    sizes. Scheduler thread only."""

    def __init__(self, file_bytes: int) -> None:
        #: An uncompressed block file's bytes: the expected size before any is recorded.
        self.file_bytes = file_bytes
        self.total = 0
        self._sizes: dict[OffloadKey, int] = {}

    def resize(self, key: OffloadKey, size: int) -> None:
        """Record the bytes of ``key``'s file."""
        self.total += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def forget(self, keys: Sequence[OffloadKey]) -> int:
        """Forget the sizes of ``keys`` (out of the index); returns their bytes."""
        pop, freed = self._sizes.pop, 0
        for key in keys:
            freed += pop(key, 0)
        self.total -= freed
        return freed

    def mean(self) -> int:
        """The bytes a new block's file is expected to take: the mean so far (at least
        :data:`MIN_FILE`), or an uncompressed file's bytes before any is recorded."""
        if not self._sizes:
            return self.file_bytes
        return max(MIN_FILE, self.total // len(self._sizes))

    def clear(self) -> None:
        self._sizes.clear()
        self.total = 0
