"""Prefix-hit rate of each eviction policy on traces (token-weighted, or by blocks): ``kvoffload bench trace``.

Usage (every flag of ``kvoffload bench trace --help``)::

    .venv/bin/python benchmarks/trace_hit_rate.py --dataset-path TRACE.jsonl [--generate suite]
        [--capacities 250,1000,4000,16000,64000] [--policies lru,arc,...] [--plot FILE.png]

The replay and its references live in :mod:`kvoffload.benchmark.hit_rate`, the generated suite in
:mod:`kvoffload.benchmark.traces`; this script only runs the command.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffload.cli.main import main as kvoffload_main


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    return kvoffload_main(["bench", "trace", *args])


if __name__ == "__main__":
    sys.exit(main())
