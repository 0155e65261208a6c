"""Names a package exports but imports on first use (PEP 562), so that ``import kvoffload`` stays
light: torch, redis-py and the engine load only when a class that needs them is asked for; and
the forwarding of a module path that moved (it keeps working, with a deprecation warning)."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports", "moved_module"]


def lazy_exports(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``table`` (name -> module that
    defines it) is imported from its module on first access and then cached in the package."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__


def moved_module(old: str, new: str) -> Callable[[str], Any]:
    """``__getattr__`` for a module that moved from ``old`` to ``new``: each name is looked up in
    ``new``, with a :class:`DeprecationWarning` that names the new path."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old} moved to {new}; import {name} from {new} (or from its package)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__
