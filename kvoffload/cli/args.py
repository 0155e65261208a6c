"""argparse ``type=`` converters that check a flag's value where it is parsed: a bad value is a
usage error naming the flag and the value (exit status 2), never a traceback later, and never a
NaN or infinity that silently changes what runs."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from kvoffload.errors import ConfigError

__all__ = ["check_output_path", "int_in", "real_in"]


def int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]``."""
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def real_in(minimum: float, *, positive: bool = False) -> Callable[[str], float]:
    """A finite number ``>= minimum`` (``> minimum`` when ``positive``)."""
    bound = f"> {minimum:g}" if positive else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (positive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def check_output_path(setting: str, path: str) -> None:
    """Raise :class:`ConfigError` unless a file can be written at ``path`` (checked before a long
    run, so that its results are not lost at the end). Creates nothing."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ConfigError(setting, f"{path!r} is a directory")
    if not parent.is_dir():
        raise ConfigError(setting, f"directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(setting, f"{path!r} is not writable")
