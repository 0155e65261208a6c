"""Operator pins of the disk tier, kept across restarts: ``pins.json`` in the model's namespace.

The file lists each pin that names the disk tier (owner, block keys in hex, tokens, expiry in
wall-clock seconds or ``null``). It is rewritten whole (a temporary file renamed over it) after
every pin, unpin and expiry, and read once at start, after the tier indexed the blocks found on
disk, so that those blocks are held again before any store could evict them. A file that cannot
be read is ignored (logged) and a pin whose blocks are no longer on disk is dropped: a damaged
pin list never stops an engine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvoffload.keys import OffloadKey

__all__ = ["PIN_FILE", "DiskPinFile", "SavedPin"]

logger = logging.getLogger(__name__)

PIN_FILE = "pins.json"
_MAX_FILE_BYTES = 64 * 2**20


class _PinLike(Protocol):
    owner: str
    keys: tuple[OffloadKey, ...]
    num_tokens: int
    expires_at: float | None


@dataclass(frozen=True, slots=True)
class SavedPin:
    owner: str
    keys: tuple[OffloadKey, ...]
    num_tokens: int
    expires_at: float | None


@dataclass
class DiskPinFile:
    """``namespace / pins.json``; ``dropped`` collects why saved pins were not held again."""

    namespace: Path
    dropped: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.namespace / PIN_FILE

    def load(self) -> list[SavedPin]:
        try:
            if self.path.stat().st_size > _MAX_FILE_BYTES:
                raise ValueError("larger than 64 MiB")
            raw = json.loads(self.path.read_text())
            return [_saved(entry) for entry in raw["pins"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the disk tier's pin list %s: %s", self.path, exc)
            return []

    def save(self, pins: Sequence[_PinLike]) -> None:
        body = {"pins": [
            {"owner": p.owner, "keys": [k.hex() for k in p.keys], "tokens": p.num_tokens,
             "expires_at": p.expires_at}
            for p in pins
        ]}
        tmp = self.path.with_name(f".{PIN_FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("could not save the disk tier's pin list %s: %s", self.path, exc)


def _saved(entry: Any) -> SavedPin:
    expires = entry["expires_at"]
    if expires is not None and not isinstance(expires, int | float):
        raise TypeError(f"expires_at {expires!r}")
    keys = tuple(OffloadKey(bytes.fromhex(k)) for k in entry["keys"])
    return SavedPin(str(entry["owner"]), keys, int(entry["tokens"]), expires)
