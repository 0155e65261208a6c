"""The disk tier's directory: creating and checking a namespace, and the ``O_DIRECT`` probe.

Every problem is a :class:`~kvoffload.errors.ConfigError` naming the setting (``kv_disk_path``,
``kv_disk_o_direct``) and saying what is wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.tiers.codec import lossy_layout
from kvoffload.tiers.contract import KVLayout
from kvoffload.tiers.disk.ledger import SpaceLedger

__all__ = [
    "check_disk_path",
    "check_disk_size",
    "check_o_direct",
    "free_bytes",
    "join_namespace",
    "prepare_namespace",
    "superseded_namespaces",
    "warn_if_filesystem_smaller",
]

logger = logging.getLogger(__name__)

_GIB = 2**30

#: The directory under the tier's root that holds one namespace per KV layout. ``v2``: the
#: layout names its model by content (``kvoffload.identity``); ``v1`` named it by its path, and
#: its namespaces are removed once unused (``diskreclaim``).
FORMAT_DIR = "kvoffload-v2"
#: Times a namespace is made again when other processes' reclaims keep removing it meanwhile.
_REMAKE_TRIES = 100


def check_disk_path(root: Path) -> Path:
    """:class:`ConfigError` naming ``kv_disk_path`` unless ``root`` is a directory or can be
    created as one (its nearest existing ancestor is a directory we may add to); returns that
    nearest existing directory (``root`` itself when it exists). Creates nothing."""
    if str(root) == "":
        raise ConfigError("kv_disk_path", "must not be empty")
    if root.exists() and not root.is_dir():
        raise ConfigError("kv_disk_path", f"{str(root)!r} exists and is not a directory")
    ancestor = root
    while not ancestor.exists():  # ends: "/" and "." exist
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(
            "kv_disk_path",
            f"{str(root)!r} cannot be created: {str(ancestor)!r} is a file, not a directory",
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            "kv_disk_path", f"{str(ancestor)!r} is not writable (no permission to add to it)"
        )
    return ancestor


def check_disk_size(directory: Path, size_gib: float) -> None:
    """:class:`ConfigError` naming ``kv_disk_size`` when ``size_gib`` is more than the whole
    filesystem of ``directory`` (an existing directory) holds: such a bound can never be
    reached, so it is a mistake (a size in bytes, a missing unit). A bound between the free
    space and the filesystem's size is accepted; the tier warns at start and holds what fits."""
    st = os.statvfs(directory)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if size_gib * _GIB > total:
        raise ConfigError(
            "kv_disk_size",
            f"{size_gib!r} GiB is more than the filesystem of {str(directory)!r} holds "
            f"({total / _GIB:.4g} GiB in all, {free / _GIB:.4g} GiB free)",
        )


def prepare_namespace(root: Path, layout: KVLayout, suffix: str = "") -> Path:
    """Create (if needed) and check the namespace directory for ``layout`` under ``root``
    (its name: the layout's fingerprint in hex, then ``suffix``)."""
    check_disk_path(root)
    namespace = root / FORMAT_DIR / (layout.fingerprint().hex() + suffix)
    for _ in range(_REMAKE_TRIES):
        try:
            namespace.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("kv_disk_path", f"cannot create {str(namespace)!r}: {exc}") from exc
        probe = namespace / f".probe.{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            return namespace
        except FileNotFoundError:
            continue  # reclaimed by another process since it was made: made again
        except OSError as exc:
            raise ConfigError("kv_disk_path", f"{str(root)!r} is not writable: {exc}") from exc
    raise _remade_too_often(namespace)


def join_namespace(
    root: Path, layout: KVLayout, suffix: str, capacity: int
) -> tuple[Path, SpaceLedger, bool]:
    """Make ``layout``'s namespace (:func:`prepare_namespace`) and open its ledger, holding its
    ``users`` lock (:meth:`SpaceLedger.join`); returns them and whether this process is alone
    there (the lock exclusive until :meth:`SpaceLedger.share`). A namespace that another
    process reclaimed (:mod:`~kvoffload.tiers.disk.reclaim`: a tier of the other
    ``kv_disk_compression`` removes it while no process holds the lock) between its making and
    the lock is made again; once the lock is held, no reclaim removes it."""
    for _ in range(_REMAKE_TRIES):
        namespace = prepare_namespace(root, layout, suffix)
        try:
            ledger = SpaceLedger(namespace / "ledger", capacity)
        except FileNotFoundError:
            continue  # reclaimed since it was made
        alone = ledger.join()
        if alone is not None:
            return namespace, ledger, alone
        ledger.close()
    raise _remade_too_often(root / FORMAT_DIR / (layout.fingerprint().hex() + suffix))


def _remade_too_often(namespace: Path) -> ConfigError:
    return ConfigError(
        "kv_disk_path",
        f"{str(namespace)!r} was removed by other processes {_REMAKE_TRIES} times as it was made",
    )


def superseded_namespaces(namespace: Path, layout: KVLayout) -> list[Path]:
    """The namespaces beside ``namespace`` that ``layout``'s blocks have under the other
    ``kv_disk_compression`` settings (raw: the fingerprint; compressed: it + ``.z``; fp8: the
    lossy layout's fingerprint + ``.z``). A tier never reads them: they are reclaimed."""
    fingerprint = layout.fingerprint().hex()
    names = {fingerprint, fingerprint + ".z", lossy_layout(layout).fingerprint().hex() + ".z"}
    return [namespace.parent / name for name in sorted(names) if name != namespace.name]


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer can still put on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def warn_if_filesystem_smaller(
    root: Path, namespace: Path, bound: int, capacity: int, used: int
) -> None:
    """Warn when the filesystem of ``namespace`` cannot hold ``capacity`` bytes of block files
    (``used`` of them there already; ``bound``: the tier's whole ``kv_disk_size`` in bytes, for
    the message): the tier then holds what fits (a write that finds it full lowers the tier's
    limit, see :mod:`~kvoffload.tiers.disk.jobs`)."""
    holds = used + free_bytes(namespace)
    if capacity > holds:
        logger.warning(
            "kv_disk_size: %.4g GiB is more than the filesystem of %r can hold for the disk "
            "tier (%.4g GiB: %.4g GiB free + %.4g GiB of its files): the tier holds what "
            "fits and evicts when the filesystem is full",
            bound / _GIB,
            str(root),
            holds / _GIB,
            (holds - used) / _GIB,
            used / _GIB,
        )


def check_o_direct(namespace: Path, pool: memoryview, block_bytes: int) -> None:
    """:class:`ConfigError` unless ``O_DIRECT`` I/O between ``pool`` and files in ``namespace``
    can work: 4 KiB aligned blocks and pool, and a filesystem that accepts the flag."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(pool)) if not pool.readonly else 0
    if block_bytes % 4096 or address % 4096:
        raise ConfigError(
            "kv_disk_o_direct",
            f"O_DIRECT needs 4 KiB aligned blocks and pool (block {block_bytes} bytes, "
            f"pool at {address:#x})",
        )
    probe = namespace / f".odirect.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(
            "kv_disk_o_direct", f"the filesystem of {str(namespace)!r} refuses O_DIRECT: {exc}"
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
