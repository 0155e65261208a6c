"""The one reader of Mooncake-format JSONL traces, for every command that takes one (``bench
throughput --dataset-name trace``, ``bench trace``), so that a bad trace gets the same words
everywhere: :class:`ConfigError` naming ``dataset_path``, the file and line, and what is wrong.

A record is a JSON object: ``hash_ids``, the ids of its 512-token blocks in prefix order (equal
ids are a shared prefix; integers in ``[0, 2**63)``), and optionally ``input_length`` and
``output_length`` (token counts, non-negative integers) and ``timestamp`` (milliseconds, a
finite number). Blank lines and records without hash ids are skipped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.benchmark.traces import BLOCK_TOKENS
from kvoffload.errors import ConfigError

__all__ = ["TraceRecord", "check_trace_path", "read_trace"]

_MAX_ID = 2**63  # ids become 8-byte keys
_DEFAULT_OUTPUT_LENGTH = 16


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace; ``arrival_s``: its timestamp in seconds."""

    hash_ids: list[int]
    input_length: int
    output_length: int
    arrival_s: float


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first ``limit`` (default: all) records with hash ids of the trace at ``path``, in
    file order. :class:`ConfigError` when the file is missing, holds no such record, or a line
    before the last one read is not a record (``FILE:LINE: not a Mooncake trace record (WHY)``)."""
    trace = check_trace_path(path)
    records: list[TraceRecord] = []
    with trace.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            record = _record(trace, line_no, raw)
            if record is not None:
                records.append(record)
    if not records:
        raise ConfigError("dataset_path", f"{trace} holds no requests")
    return records


def check_trace_path(path: str | Path) -> Path:
    """``path`` if a trace can be read from it: a file, or a named pipe (``<(zcat t.gz)``);
    else :class:`ConfigError`. Reads nothing."""
    trace = Path(path)
    if not trace.exists() or trace.is_dir():
        raise ConfigError("dataset_path", f"{str(path)!r} is not a file")
    return trace


def _record(trace: Path, line_no: int, raw: bytes) -> TraceRecord | None:
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
        bad, "input_length", record.get("input_length", len(hash_ids) * BLOCK_TOKENS)
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
