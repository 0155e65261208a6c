"""The kvoffload exception hierarchy.

::

    KVOffloadError                     base of every error kvoffload raises on purpose
    ├── ConfigError (ValueError)       a configuration value is invalid; the message names the field
    ├── ContractError (RuntimeError)   a caller broke a documented contract (unknown key in
    │                                  complete_load, lifecycle misuse); state is left unchanged
    ├── TransferError                  a medium or copy failed; callers fall back to recompute
    └── HostAllocationError (MemoryError)  a host buffer could not be allocated (size in message)

Three registers, as the style guide asks: impossible requests raise ``ConfigError``/``ValueError``
with the numbers in the message; contract violations raise ``ContractError`` and mutate nothing;
medium failures are translated at the backend boundary into ``TransferError`` (``raise ... from
exc``) so that the serving path only ever catches ``TransferError`` and recomputes.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContractError",
    "HostAllocationError",
    "KVOffloadError",
    "TransferError",
]


class KVOffloadError(Exception):
    """Base class of every error kvoffload raises on purpose."""


class ConfigError(KVOffloadError, ValueError):
    """A configuration value is invalid. The message names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # Rebuilt from both arguments, so that it crosses process boundaries (pickle).
        return type(self), (self.field, self.message)


class ContractError(KVOffloadError, RuntimeError):
    """A caller broke a documented contract. Raised before any state is changed."""


class TransferError(KVOffloadError):
    """Moving bytes to or from a medium failed. The data involved must be treated as absent."""


class HostAllocationError(KVOffloadError, MemoryError):
    """A host buffer could not be allocated."""

    def __init__(self, num_bytes: int, detail: str) -> None:
        gib = num_bytes / 2**30
        super().__init__(
            f"could not allocate {num_bytes} bytes ({gib:.2f} GiB) of host memory: {detail}"
        )
        self.num_bytes = num_bytes
        self.detail = detail

    def __reduce__(self) -> tuple[type[HostAllocationError], tuple[int, str]]:
        # Rebuilt from both arguments, so that it crosses process boundaries (pickle).
        return type(self), (self.num_bytes, self.detail)
