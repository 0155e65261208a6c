"""Block-level prefix-hit ratio of each eviction policy on a Mooncake-format trace.

Usage::

    .venv/bin/python benchmarks/trace_hit_rate.py [TRACE] [--capacities 1000,4000,16000]
        [--policies lru,arc,...] [--limit N]

TRACE is a JSONL file, one request per line, whose ``hash_ids`` field lists the request's block
ids in prefix order (equal ids = the same block, so equal leading ids = a shared prefix). Default:
``/work/shared/traces/conversation_trace.jsonl``.

Every request is replayed through a real :class:`~kvoffload.managers.CPUOffloadingManager` (key of
id ``i`` = ``make_offload_key(i.to_bytes(8, "big"))``, one ``ReqContext`` per request): ``lookup``
until the first miss (its hits are that leading run), ``prepare_load``/``complete_load`` the hits,
``touch`` every key of the request, ``prepare_store``/``complete_store`` the rest,
``request_finished``. The figure is hits / blocks over the whole trace.

Two references are computed in the same run, outside the manager:

``infinite``
    A cache that never evicts: every block seen before is a hit if its whole prefix was seen.
``belady``
    Clairvoyant eviction: after each request, while over capacity, drop the block whose next use
    (counted in block references, so later positions of one request come later) is farthest,
    the request's own new blocks included (an optimal cache may decline to keep them).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffload.base import ReqContext
from kvoffload.benchmark.replay import serve_request
from kvoffload.eviction import available_eviction_policies
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.managers import CPUOffloadingManager

DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"
_NEVER = 1 << 62


def load_trace(path: str, limit: int | None = None) -> list[list[int]]:
    """Return the ``hash_ids`` of every request of a Mooncake-format JSONL trace."""
    requests: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(
                    f"{path}:{line_no}: not a JSON object with 'hash_ids' ({exc})"
                ) from None
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise SystemExit(
                    f"{path}:{line_no}: 'hash_ids' must be a list of non-negative integers"
                )
            requests.append(ids)
            if limit is not None and len(requests) >= limit:
                break
    return requests


def infinite_hit_ratio(requests: Sequence[Sequence[int]]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for ids in requests:
        for block_id in ids:
            if block_id not in seen:
                break
            hits += 1
        total += len(ids)
        seen.update(ids)
    return hits / max(total, 1)


def belady_hit_ratio(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Clairvoyant (farthest next use first, bypass allowed) prefix-hit ratio."""
    # next_use[i][id]: block-reference time of the next request that names id after request i.
    next_use: list[dict[int, int]] = [{}] * len(requests)
    last: dict[int, int] = {}
    clock = sum(len(ids) for ids in requests)
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i]
        clock -= len(ids)
        next_use[i] = {b: last.get(b, _NEVER) for b in ids}
        for pos, b in enumerate(ids):
            last[b] = clock + pos
    cached: dict[int, int] = {}  # id -> next use; the heap holds stale entries too
    heap: list[tuple[int, int]] = []
    hits = total = 0
    for i, ids in enumerate(requests):
        for block_id in ids:
            if block_id not in cached:
                break
            hits += 1
        total += len(ids)
        for block_id, t in next_use[i].items():
            cached[block_id] = t
            heapq.heappush(heap, (-t, block_id))
        while len(cached) > capacity:
            neg_t, block_id = heapq.heappop(heap)
            if cached.get(block_id) == -neg_t:
                del cached[block_id]
    return hits / max(total, 1)


def replay(
    requests: Sequence[Sequence[int]], keys: dict[int, OffloadKey], policy: str, capacity: int
) -> float:
    """Prefix-hit ratio of ``policy`` at ``capacity`` blocks, through the real manager."""
    manager = CPUOffloadingManager(capacity, eviction_policy=policy)
    hits = total = 0
    for i, ids in enumerate(requests):
        hits += serve_request(manager, [keys[b] for b in ids], ReqContext(f"req-{i}"))
        total += len(ids)
    return hits / max(total, 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    parser.add_argument(
        "--capacities", default="1000,4000,16000", help="comma-separated tier sizes in blocks"
    )
    parser.add_argument(
        "--policies", default=None, help="comma-separated policy names (default: all registered)"
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = parser.parse_args(argv)

    capacities = [int(c) for c in args.capacities.split(",") if c.strip()]
    if not capacities or min(capacities) <= 0:
        raise SystemExit("--capacities: give positive block counts, e.g. 1000,4000")
    policies = args.policies.split(",") if args.policies else available_eviction_policies()
    unknown = sorted(set(policies) - set(available_eviction_policies()))
    if unknown:
        raise SystemExit(
            f"--policies: unknown {unknown}; registered: {available_eviction_policies()}"
        )

    requests = load_trace(args.trace, args.limit)
    distinct = {b for ids in requests for b in ids}
    keys = {b: make_offload_key(b.to_bytes(8, "big")) for b in distinct}
    n_blocks = sum(len(ids) for ids in requests)
    print(
        f"trace {args.trace}: {len(requests)} requests, {n_blocks} blocks, {len(distinct)} distinct"
    )
    print("block-level prefix-hit ratio (hits / blocks)\n")

    width = 10
    print(f"{'policy':<22}" + "".join(f"{c:>{width}}" for c in capacities) + "   replay s")
    inf = infinite_hit_ratio(requests)
    print(f"{'infinite (reference)':<22}" + "".join(f"{inf:>{width}.4f}" for _ in capacities))
    belady = [belady_hit_ratio(requests, c) for c in capacities]
    print(f"{'belady (reference)':<22}" + "".join(f"{r:>{width}.4f}" for r in belady))
    results: dict[str, list[float]] = {}
    for name in policies:
        start = time.perf_counter()
        results[name] = [replay(requests, keys, name, c) for c in capacities]
        elapsed = time.perf_counter() - start
        print(
            f"{name:<22}"
            + "".join(f"{r:>{width}.4f}" for r in results[name])
            + f"{elapsed:>11.1f}",
            flush=True,
        )
    if "lru" in results:
        print("\nratio to lru")
        base = results["lru"]
        for name, row in results.items():
            cells = "".join(
                f"{r / b if b else float('nan'):>{width}.2f}"
                for r, b in zip(row, base, strict=True)
            )
            print(f"{name:<22}" + cells)


if __name__ == "__main__":
    main()
