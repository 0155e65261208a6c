"""The one reader of Mooncake-format JSONL traces, for every command that takes one (``bench
throughput --dataset-name trace``, ``bench trace``), so that a bad trace gets the same words
everywhere: :class:`ConfigError` naming ``dataset_path``, the file and line, and what is wrong.

A record is a JSON object: ``hash_ids``, the ids of its 512-token blocks in prefix order (equal
ids are a shared prefix; integers in ``[0, 2**63)``), and optionally ``input_length`` and
``output_length`` (token counts, non-negative integers) and ``timestamp`` (milliseconds, a
finite number). Blank lines and records without hash ids are skipped. A path ending in ``.gz`` is
read through gzip; ``-`` is standard input (read once).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.benchmark.traces import BLOCK_TOKENS
from kvoffload.errors import ConfigError

__all__ = ["STDIN", "TraceRecord", "check_trace_path", "read_trace"]

#: The path that names standard input.
STDIN = "-"

_MAX_ID = 2**63  # ids become 8-byte keys
_DEFAULT_OUTPUT_LENGTH = 16


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace; ``arrival_s``: its timestamp in seconds."""

    hash_ids: list[int]
    input_length: int
    output_length: int
    arrival_s: float


def read_trace(
    path: str | Path, limit: int | None = None, block_size: int = BLOCK_TOKENS
) -> list[TraceRecord]:
    """The first ``limit`` (default: all) records with hash ids of the trace at ``path`` (``.gz``:
    gzip; ``-``: standard input), in file order; a record without ``input_length`` has
    ``block_size`` tokens per block. :class:`ConfigError` when the file is missing or not gzip
    where named so, holds no such record, or a line before the last one read is not a record
    (``FILE:LINE: not a Mooncake trace record (WHY)``)."""
    trace = check_trace_path(path)
    name = "<stdin>" if str(path) == STDIN else str(trace)
    records: list[TraceRecord] = []
    with _lines(trace, name) as lines:
        for line_no, raw in enumerate(lines, 1):
            if limit is not None and len(records) >= limit:
                break
            record = _record(name, line_no, raw, block_size)
            if record is not None:
                records.append(record)
    if not records:
        raise ConfigError("dataset_path", f"{name} holds no requests")
    return records


def check_trace_path(path: str | Path) -> Path:
    """``path`` if a trace can be read from it: ``-`` (standard input), a file, or a named pipe
    (``<(zcat t.gz)``); else :class:`ConfigError`. Reads nothing."""
    trace = Path(path)
    if str(path) == STDIN:
        return trace
    if not trace.exists() or trace.is_dir():
        raise ConfigError("dataset_path", f"{str(path)!r} is not a file")
    return trace


@contextlib.contextmanager
def _lines(trace: Path, name: str) -> Iterator[Iterator[bytes]]:
    """The raw lines of the trace; a gzip file that is not one is a :class:`ConfigError`."""
    if str(trace) == STDIN:
        yield iter(sys.stdin.buffer)
        return
    with gzip.open(trace, "rb") if trace.suffix == ".gz" else trace.open("rb") as stream:
        try:
            yield iter(stream)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise ConfigError("dataset_path", f"{name}: not gzip, or cut short ({exc})") from None


def _record(trace: str, line_no: int, raw: bytes, block_size: int) -> TraceRecord | None:
    """The record of one line (``None`` for a blank line or one without hash ids)."""

    def bad(why: str) -> ConfigError:
        return ConfigError(
            "dataset_path", f"{trace}:{line_no}: not a Mooncake trace record ({why})"
        )

    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise bad(f"not JSON: {exc.msg[0].lower()}{exc.msg[1:]} at column {exc.colno}") from None
    if not isinstance(record, dict) or not isinstance(record.get("hash_ids"), list):
        raise bad("an object with a hash_ids list expected")
    hash_ids = [_count(bad, "hash_ids", h, _MAX_ID) for h in record["hash_ids"]]
    if not hash_ids:
        return None
    input_length = _count(
        bad, "input_length", record.get("input_length", len(hash_ids) * block_size)
    )
    output_length = _count(
        bad, "output_length", record.get("output_length", _DEFAULT_OUTPUT_LENGTH)
    )
    timestamp_ms = record.get("timestamp", 0)
    if (
        isinstance(timestamp_ms, bool)
        or not isinstance(timestamp_ms, int | float)
        or not math.isfinite(timestamp_ms)
    ):
        raise bad(f"timestamp must be a finite number of milliseconds, got {timestamp_ms!r}")
    return TraceRecord(hash_ids, input_length, output_length, timestamp_ms / 1000)


def _count(bad: Any, name: str, value: object, below: int | None = None) -> int:
    """``value`` if it is a JSON integer >= 0 (and < ``below``): ``1e400``, ``2.5`` or ``true``
    is no count or id."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 0
        or (below is not None and value >= below)
    ):
        limit = "" if below is None else " below 2**63"
        raise bad(f"{name} must be non-negative integers{limit}, got {value!r}")
    return value
