"""Prefix-hit ratio of vLLM's built-in cache policies and ours, inside vLLM 0.33's own
``CPUOffloadingManager`` (needs vLLM installed: ``make test-vllm`` does it).

Usage::

    .venv/bin/python benchmarks/vllm_policy_hit_rate.py TRACE [--capacities 1000,4000,16000]
        [--limit N]

TRACE is a Mooncake-format JSONL file (``hash_ids`` per request), e.g. the conversation trace.
Every request is served as vLLM's scheduler-side connector serves it
(:func:`kvoffload.integrations.vllm.replay.serve_request`: lookups until the first miss, load
the hits, store the rest, finish; vLLM never calls ``touch``). The policies are vLLM's ``lru``
and ``arc`` and our ``KVOffload*`` classes loaded through ``cache_policy_module_path``, exactly
as ``--kv-transfer-config`` would load them. Deterministic: one run is the figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffload.benchmark.hit_rate import (
    belady_hit_ratio,
    block_keys,
    infinite_hit_ratio,
    load_trace,
)

POLICIES = (
    ("lru", None),
    ("arc", None),
    ("KVOffloadLRU", "ours"),
    ("KVOffloadARC", "ours"),
    ("KVOffloadS3FIFO", "ours"),
    ("KVOffloadPrefix", "ours"),
    ("KVOffloadAdaptive", "ours"),
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--capacities", default="1000,4000,16000", help="CPU tier sizes in chunks")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",") if c.strip()]
    if not capacities or min(capacities) <= 0:
        raise SystemExit("--capacities: give positive chunk counts, e.g. 1000,4000")

    from kvoffload.integrations.vllm.replay import POLICY_MODULE, hit_ratio

    requests = load_trace(args.trace, args.limit)
    keys = block_keys(requests)
    vllm_keys = cast("dict[int, Any]", keys)  # the same bytes as vLLM's OffloadKey (a NewType)
    print(
        f"trace {Path(args.trace).name}: {len(requests)} requests, {sum(map(len, requests))} blocks"
    )
    print("prefix-hit ratio inside vLLM 0.33's CPUOffloadingManager\n")
    width = 10
    print(f"{'policy':<24}" + "".join(f"{c:>{width}}" for c in capacities) + "   replay s")
    inf = infinite_hit_ratio(requests)
    print(f"{'infinite (reference)':<24}" + "".join(f"{inf:>{width}.4f}" for _ in capacities))
    belady = [belady_hit_ratio(requests, c) for c in capacities]
    print(f"{'belady (reference)':<24}" + "".join(f"{r:>{width}.4f}" for r in belady))
    rows: dict[str, list[float]] = {}
    for name, module in POLICIES:
        start = time.perf_counter()
        path = POLICY_MODULE if module else None
        rows[name] = [hit_ratio(requests, vllm_keys, name, c, path) for c in capacities]
        label = name if module else f"vLLM {name}"
        print(
            f"{label:<24}"
            + "".join(f"{r:>{width}.4f}" for r in rows[name])
            + f"{time.perf_counter() - start:>11.1f}",
            flush=True,
        )
    print("\nratio to vLLM lru")
    for name, row in rows.items():
        label = name if dict(POLICIES)[name] else f"vLLM {name}"
        print(
            f"{label:<24}"
            + "".join(
                f"{r / b if b else float('nan'):>{width}.2f}"
                for r, b in zip(row, rows["lru"], strict=True)
            )
        )


if __name__ == "__main__":
    main()
