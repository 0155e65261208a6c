"""argparse ``type=`` converters that check a flag's value where it is parsed: a bad value is a
usage error naming the flag and the value (exit status 2), never a traceback later, and never a
NaN or infinity that silently changes what runs. Each converter carries its range as ``bound``
(``">= 1"``), which ``--help`` states. :class:`CommandParser` reports a usage error in two
lines: the command's usage (short) and the error."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kvoffload.errors import ConfigError

__all__ = ["CommandParser", "check_output_path", "int_in", "real_in"]

#: A usage of more lines than this is shown as ``usage: PROG [options]`` in errors.
_SHORT_USAGE_LINES = 3


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are two lines, ``usage: ...`` and ``PROG: error:
    ...`` (a long usage is shortened to ``PROG [options]``; ``--help`` lists the flags), exit 2.
    Subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage().strip()
        if usage.count("\n") >= _SHORT_USAGE_LINES:
            usage = f"usage: {self.prog} [options]   ({self.prog} --help lists them)"
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")


def int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]``."""
    top: int | str | None = maximum
    if maximum is not None and maximum > 2**20 and (maximum + 1).bit_count() == 1:
        top = f"2**{maximum.bit_length()} - 1"
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {top}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    parse.__name__ = "integer"
    parse.bound = bound  # type: ignore[attr-defined]  # the range --help states (Flag.help_text reads it)
    return parse


def real_in(
    minimum: float, *, positive: bool = False, below: float | None = None
) -> Callable[[str], float]:
    """A finite number ``>= minimum`` (``> minimum`` when ``positive``), and ``< below``."""
    bound = f"> {minimum:g}" if positive else f">= {minimum:g}"
    if below is not None:
        bound = f"in {'(' if positive else '['}{minimum:g}, {below:g})"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        if (
            not math.isfinite(value)
            or value < minimum
            or (positive and value == minimum)
            or (below is not None and value >= below)
        ):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = "number"
    parse.bound = bound  # type: ignore[attr-defined]  # the range --help states (Flag.help_text reads it)
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
