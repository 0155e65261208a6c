"""Checks of user-facing values at the boundary: each raises :class:`ConfigError` naming the setting
and the bad value, or returns the value. ``bool`` is never accepted as a number, and floats must
be finite (NaN compares false with everything, so an unchecked NaN silently passes ``x < 0``).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from kvoffload.errors import ConfigError

__all__ = [
    "accepts_renamed",
    "check_bool",
    "check_choice",
    "check_int",
    "check_real",
    "check_str",
    "renamed_settings",
]

_T = TypeVar("_T")


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, f"must be <= {maximum}, got {value!r}")
    return value


def check_real(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    positive: bool = False,
    unit: str = "",
) -> float:
    """``value`` as a float if it is a finite ``int``/``float`` (not a ``bool``) in
    ``[minimum, maximum]`` (``> 0`` when ``positive``). ``unit`` is named in the message."""
    suffix = f" ({unit})" if unit else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number{suffix}, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:
        raise ConfigError(name, f"must be a finite number{suffix}, got {value!r}") from None
    if not math.isfinite(as_float):
        raise ConfigError(name, f"must be a finite number{suffix}, got {value!r}")
    if positive and as_float <= 0:
        raise ConfigError(name, f"must be > 0{suffix}, got {value!r}")
    if minimum is not None and as_float < minimum:
        raise ConfigError(name, f"must be >= {minimum}{suffix}, got {value!r}")
    if maximum is not None and as_float > maximum:
        raise ConfigError(name, f"must be <= {maximum:g}{suffix}, got {value!r}")
    return as_float


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be True or False, got {value!r}")
    return value


def check_str(name: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    """``value`` if it is one of ``choices`` (a ``str``: unhashable values raise no TypeError)."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(name, f"unknown value {value!r}; choose from {sorted(choices)}")
    return value


def renamed_settings(
    settings: Mapping[str, Any], renames: Mapping[str, str], stacklevel: int = 2
) -> dict[str, Any]:
    """``settings`` with every deprecated name (a key of ``renames``) replaced by its new name.

    Each old name used warns once per call with a :class:`DeprecationWarning` naming the new
    one (``stacklevel`` counts from the caller of this function, as in :func:`warnings.warn`).
    Both spellings of one setting at once is a :class:`ConfigError` naming the new one.
    """
    out = dict(settings)
    for old, new in renames.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(new, f"given twice: as {new!r} and as its deprecated alias {old!r}")
        warnings.warn(
            f"{old!r} is deprecated and will be removed in the next release; use {new!r}",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )
        out[new] = out.pop(old)
    return out


def accepts_renamed(renames: Mapping[str, str]) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: the class's ``__init__`` also takes the deprecated keyword names of
    ``renames`` (old -> new), passing them on under their new names (see
    :func:`renamed_settings`). ``inspect.signature`` still shows the new names only."""

    def decorate(cls: type[_T]) -> type[_T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: _T, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **renamed_settings(kwargs, renames, stacklevel=2))

        # Replacing a class's method: mypy refuses it, and types the wrapper as functools'.
        cls.__init__ = __init__  # type: ignore[method-assign,assignment]
        return cls

    return decorate
