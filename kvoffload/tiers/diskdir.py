"""The disk tier's directory: creating and checking a namespace, and the ``O_DIRECT`` probe.

Every problem is a :class:`~kvoffload.errors.ConfigError` naming the setting (``kv_disk_path``,
``kv_disk_o_direct``) and saying what is wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.tiers.base import KVLayout

__all__ = ["check_o_direct", "free_bytes", "prepare_namespace"]

#: The directory under the tier's root that holds one namespace per KV layout.
FORMAT_DIR = "kvoffload-v1"


def prepare_namespace(root: Path, layout: KVLayout) -> Path:
    """Create (if needed) and check the namespace directory for ``layout`` under ``root``."""
    if root.exists() and not root.is_dir():
        raise ConfigError("kv_disk_path", f"{str(root)!r} exists and is not a directory")
    namespace = root / FORMAT_DIR / layout.fingerprint().hex()
    try:
        namespace.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("kv_disk_path", f"cannot create {str(namespace)!r}: {exc}") from exc
    probe = namespace / f".probe.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("kv_disk_path", f"{str(root)!r} is not writable: {exc}") from exc
    return namespace


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer can still put on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


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
