"""How every ``kvoffload`` command ends, in one place: :func:`command` wraps a command's function
so that it returns its exit status, a :class:`KVOffloadError` (bad settings, a tier that cannot
start) is one line ``error: SETTING: ...`` and exit status 2, and Ctrl-C (SIGINT) is one line
``PROG: interrupted`` and exit status 130 (128 + SIGINT, what shells report), never a traceback.

Cleanup runs before the line is printed: the interrupt unwinds the command's ``with`` blocks
(engines closed, temporary directories removed, servers stopped) on its way out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any, TextIO

from kvoffload.errors import KVOffloadError

__all__ = ["EXIT_INTERRUPTED", "EXIT_MISUSE", "command"]

EXIT_MISUSE = 2
EXIT_INTERRUPTED = 130


def command(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run(args)`` with the endings above; ``args.parser.prog`` names the command."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        stderr = sys.stderr = _LineTracker(sys.stderr)
        try:
            return run(args)
        except KVOffloadError as exc:
            stderr.end_line()
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_MISUSE
        except KeyboardInterrupt:
            _close_progress_bars()
            stderr.end_line()
            parser = getattr(args, "parser", None)
            prog = parser.prog if parser is not None else "kvoffload"
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        finally:
            if sys.stderr is stderr:
                sys.stderr = stderr.stream

    return wrapper


class _LineTracker:
    """A text stream (stderr) that remembers whether its last write ended a line, so that the
    command's last line starts on a line of its own (an interrupt may land mid-line)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = text.endswith("\n")
        return self.stream.write(text)

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _close_progress_bars() -> None:
    """Close the progress bars the interrupt left open (one may have been mid-construction), so
    that each ends its line and the last line is ours."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()
