"""Helpers for the secondary-tier tests: host pools as real byte buffers, layouts, keys, and
waiting for a tier's jobs (tiers report asynchronously; waits are bounded, never timed asserts)."""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.tiers import KVLayout, SecondaryTier, TierJobResult
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import LEDGER_BYTES, DiskTier

BLOCK_BYTES = 2048


def layout(model: str = "test-model", block_bytes: int = BLOCK_BYTES) -> KVLayout:
    return KVLayout(model, "float32", 4, 2, 2, 16, block_bytes)


def host_pool(num_slots: int, block_bytes: int = BLOCK_BYTES) -> memoryview:
    """A host pool: ``num_slots`` rows of ``block_bytes`` bytes (a 2-D byte view)."""
    return memoryview(bytearray(num_slots * block_bytes)).cast("B", (num_slots, block_bytes))


def disk_tier(
    path: Path, pool: memoryview, blocks: int = 16, enable_events: bool = False, **settings
) -> DiskTier:
    """A disk tier bounded to ``blocks`` block files of :func:`layout` on real files, without
    the rescan thread unless ``rescan_interval`` says otherwise."""
    settings.setdefault("rescan_interval", 0)
    bound = LEDGER_BYTES + blocks * file_bytes(BLOCK_BYTES)
    return DiskTier(pool, layout(), DiskTierSettings(path, bound, **settings), enable_events)


def _slot_size(pool: memoryview) -> int:
    """Bytes of one slot of ``pool`` (slots x block bytes, as :func:`host_pool` makes it)."""
    return pool.nbytes // len(pool)


def slot_bytes(pool: memoryview, slot: int) -> bytes:
    b = _slot_size(pool)
    return bytes(pool.cast("B")[slot * b : (slot + 1) * b])


def fill_slot(pool: memoryview, slot: int, seed: int) -> bytes:
    """Fill ``slot`` with bytes derived from ``seed``; returns them."""
    b = _slot_size(pool)
    data = random.Random(seed).randbytes(b)
    pool.cast("B")[slot * b : (slot + 1) * b] = data
    return data


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def wait_jobs(tier: SecondaryTier) -> list[TierJobResult]:
    """Every result the tier has after all its submitted jobs finished."""
    tier.drain_jobs()
    return tier.get_finished_jobs()


def tier_file(root: Path, k: OffloadKey) -> Path:
    """Where the disk tier keeps ``k`` (its only file with that name under ``root``)."""
    found = list(root.rglob(k.hex() + ".kvb"))
    assert len(found) == 1, found
    return found[0]


def dir_bytes(root: Path) -> int:
    """Bytes the tier's files take on disk: block files, temporaries and ledger in whole 4 KiB
    blocks, each file once (a file being published has two names for an instant)."""
    sizes: dict[int, int] = {}
    for path in root.rglob("*"):
        try:
            st = path.stat()
        except FileNotFoundError:  # removed while we looked
            continue
        if path.is_file():
            sizes[st.st_ino] = -(-st.st_size // 4096) * 4096
    return sum(sizes.values())


def dir_bytes_at_once(tier: DiskTier, root: Path) -> int:
    """:func:`dir_bytes` at one instant: walked with ``tier``'s ledger locked. A walk is not
    atomic: one that counts a victim's file before a store unlinks it and its replacement after
    counts a file more than the directory ever held (a compressed tier writes new files where a
    raw one recycles the victim's). Every unlink of a victim and every reservation is a locked
    ledger step, and no file outgrows its reservation, so what a locked walk sees is at most
    the count: the bound, checked at one instant."""
    return tier._ledger.snapshot(lambda: dir_bytes(root))[1]


@contextmanager
def small_tmpfs(path: Path, size: str, free_kib: int | None = None) -> Iterator[Path]:
    """A size-limited tmpfs at ``path`` (root only; skips otherwise). ``free_kib``: another
    program's file takes all but that much (a filesystem fuller than a tier's bound, which a
    bound above the whole filesystem's size cannot model: it is refused)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        if free_kib is not None:
            st = os.statvfs(path)
            (path / "other-program.bin").write_bytes(
                bytes(st.f_bavail * st.f_frsize - free_kib * 1024)
            )
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def tier_file_or_none(root: Path, k: OffloadKey) -> Path | None:
    """Where the disk tier keeps ``k``, or None if no file of that name is under ``root``."""
    found = list(root.rglob(k.hex() + ".kvb"))
    return found[0] if found else None
