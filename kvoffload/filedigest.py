"""Content digests of large files (model weights), computed once and cached beside them.

:func:`file_digests` returns ``"xxh3-128:<hex>"`` of each file's bytes. A digest is cached in
``.kvoffload-digests.json`` in the files' directory, keyed by what changes whenever the bytes do:
size, ``st_mtime_ns``, ``st_ctime_ns`` (which no user can set back) and inode. When that
directory is not writable the cache lives under the user's cache directory
(``$XDG_CACHE_HOME/kvoffload/digests/``, else ``~/.cache/...``); when neither is, the digests
are recomputed at every call (logged once). A cache that cannot be read is ignored. Nothing here
raises for a cache problem; an unreadable weight file raises :class:`ConfigError`.

Invariant: a cached digest is only returned for a file whose key is unchanged since it was
hashed, and a digest is only cached when the file was last changed more than
:data:`RACY_WINDOW_S` before hashing began (file timestamps are coarse: a file rewritten within
one tick of the hash could otherwise keep its key with new bytes, as in git's "racily clean").
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvoffload.errors import ConfigError

__all__ = ["ALGORITHM", "CACHE_NAME", "RACY_WINDOW_S", "file_digest", "file_digests"]

log = logging.getLogger(__name__)

ALGORITHM = "xxh3-128"
CACHE_NAME = ".kvoffload-digests.json"
#: A file changed less than this before its hash began is hashed, but its digest not cached.
RACY_WINDOW_S = 2.0
_FORMAT = 1
_CHUNK = 16 << 20
_warned_uncached: set[str] = set()


def file_digest(path: Path) -> str:
    """``"xxh3-128:<hex>"`` of the bytes of ``path`` (read in 16 MiB chunks)."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    except OSError as exc:
        raise ConfigError("model", f"cannot read {path}: {exc}") from None
    return f"{ALGORITHM}:{h.hexdigest()}"


def file_digests(files: Sequence[Path]) -> list[str]:
    """The digest of each file (all in one directory), from the cache where it is current."""
    if not files:
        return []
    directory = files[0].parent
    cache = _DigestCache(directory)
    out = []
    for path in files:
        key = _key(path)
        digest = cache.get(path.name, key)
        if digest is None:
            started_ns = time.time_ns()
            digest = file_digest(path)
            if key == _key(path) and _settled(key, started_ns):
                cache.put(path.name, key, digest)
        out.append(digest)
    cache.save()
    return out


def _key(path: Path) -> dict[str, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError("model", f"cannot read {path}: {exc}") from None
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
    }


def _settled(key: dict[str, int], started_ns: int) -> bool:
    changed_ns = max(key["mtime_ns"], key["ctime_ns"])
    return changed_ns < started_ns - int(RACY_WINDOW_S * 1e9)


def _user_cache_file(directory: Path) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = xxhash.xxh3_64_hexdigest(str(directory.resolve()).encode())
    return Path(root) / "kvoffload" / "digests" / f"{name}.json"


class _DigestCache:
    """The cached entries of one directory: read from beside the files, else from the user's
    cache; written back (if anything was added) to the first of those that takes it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.places = [directory / CACHE_NAME, _user_cache_file(directory)]
        self.entries: dict[str, dict[str, Any]] = {}
        for place in reversed(self.places):  # beside the files wins
            self.entries.update(_read_entries(place))
        self.dirty = False

    def get(self, name: str, key: dict[str, int]) -> str | None:
        entry = self.entries.get(name)
        if entry is None or entry.get("key") != key:
            return None
        digest = entry.get("digest")
        return digest if isinstance(digest, str) and digest.startswith(ALGORITHM) else None

    def put(self, name: str, key: dict[str, int], digest: str) -> None:
        self.entries[name] = {"key": key, "digest": digest}
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        text = json.dumps({"format": _FORMAT, "entries": self.entries}, sort_keys=True)
        errors = []
        for place in self.places:
            try:
                _write_atomically(place, text)
                return
            except OSError as exc:
                errors.append(f"{place}: {exc.strerror or exc}")
        where = str(self.directory)
        if where not in _warned_uncached:
            _warned_uncached.add(where)
            log.warning(
                "cannot cache the weight digests of %s (%s): they are recomputed at every start",
                where,
                "; ".join(errors),
            )


def _read_entries(place: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(place.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, dict)}


def _write_atomically(place: Path, text: str) -> None:
    place.parent.mkdir(parents=True, exist_ok=True)
    tmp = place.with_name(f".{place.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, place)
    finally:
        tmp.unlink(missing_ok=True)
