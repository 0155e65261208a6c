"""Block-level prefix-hit ratio of eviction policies on a trace, with clairvoyant references.

A trace is a list of requests, each the list of its block ids in prefix order (the ``hash_ids``
of a Mooncake-format JSONL file). :func:`replay` serves every request through a real
:class:`~kvoffload.managers.CPUOffloadingManager` with :func:`~kvoffload.managers.replay.serve_request`
(lookup until the first miss, load the hits, touch every key, store the rest, finish). Each runner
gives the prefix hits of every request (``*_hits``), to be scored over any window and with any
weights (:mod:`kvoffload.benchmark.trace_score`); ``*_ratio`` is hits / blocks over the whole
trace. Two references run outside the manager:

``infinite``
    A cache that never evicts: a block is a hit if it and its whole prefix were seen before.
``belady``
    Clairvoyant eviction: after each request, while over capacity, drop the block whose next use
    (counted in block references, so later positions of one request come later) is farthest, the
    request's own new blocks included (an optimal cache may decline to keep them).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Container, Sequence
from pathlib import Path

from kvoffload.benchmark.trace_file import read_trace
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.replay import serve_request

__all__ = [
    "belady_hit_ratio",
    "belady_hits",
    "block_keys",
    "gap_closed",
    "infinite_hit_ratio",
    "infinite_hits",
    "load_trace",
    "replay",
    "replay_hits",
]

_NEVER = 1 << 62
# Requests between two progress reports (a callback per request would cost more than LRU's work).
_PROGRESS_EVERY = 256


def load_trace(path: str | Path, limit: int | None = None) -> list[list[int]]:
    """The ``hash_ids`` of the first ``limit`` (default: all) requests of a Mooncake-format JSONL
    trace (:func:`~kvoffload.benchmark.trace_file.read_trace`, its errors)."""
    return [record.hash_ids for record in read_trace(path, limit)]


def block_keys(requests: Sequence[Sequence[int]]) -> dict[int, OffloadKey]:
    """The offload key of every block id of the trace."""
    return {b: make_offload_key(b.to_bytes(8, "big")) for ids in requests for b in ids}


def _ratio(hits: Sequence[int], requests: Sequence[Sequence[int]]) -> float:
    return sum(hits) / max(sum(map(len, requests)), 1)


def infinite_hit_ratio(requests: Sequence[Sequence[int]]) -> float:
    """Hit ratio of a cache that never evicts."""
    return _ratio(infinite_hits(requests), requests)


def infinite_hits(requests: Sequence[Sequence[int]]) -> list[int]:
    """Prefix hits of every request in a cache that never evicts."""
    seen: set[int] = set()
    out = []
    for ids in requests:
        out.append(_prefix_hits(ids, seen))
        seen.update(ids)
    return out


def _prefix_hits(ids: Sequence[int], cached: Container[int]) -> int:
    """How many of ``ids``, from the first, are in ``cached`` up to the first that is not."""
    hits = 0
    for block_id in ids:
        if block_id not in cached:
            break
        hits += 1
    return hits


def belady_hit_ratio(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Clairvoyant (farthest next use first, bypass allowed) prefix-hit ratio."""
    return _ratio(belady_hits(requests, capacity), requests)


def belady_hits(requests: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Prefix hits of every request under clairvoyant eviction (farthest next use first, bypass
    allowed)."""
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
    out = []
    for i, ids in enumerate(requests):
        out.append(_prefix_hits(ids, cached))
        for block_id, t in next_use[i].items():
            cached[block_id] = t
            heapq.heappush(heap, (-t, block_id))
        while len(cached) > capacity:
            neg_t, block_id = heapq.heappop(heap)
            if cached.get(block_id) == -neg_t:
                del cached[block_id]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries: memory stays O(capacity)
            heap = [(-t, b) for b, t in cached.items()]
            heapq.heapify(heap)
    return out


def replay(
    requests: Sequence[Sequence[int]],
    keys: dict[int, OffloadKey],
    policy: str,
    capacity: int,
    progress: Callable[[int], object] | None = None,
) -> float:
    """Prefix-hit ratio of ``policy`` at ``capacity`` blocks, through the real manager
    (:func:`replay_hits`)."""
    return _ratio(replay_hits(requests, keys, policy, capacity, progress), requests)


def replay_hits(
    requests: Sequence[Sequence[int]],
    keys: dict[int, OffloadKey],
    policy: str,
    capacity: int,
    progress: Callable[[int], object] | None = None,
) -> list[int]:
    """Prefix hits of every request with ``policy`` at ``capacity`` blocks, through the real
    manager.

    ``progress(n)`` is called now and then with the number of requests served since its last call.
    """
    manager = CPUOffloadingManager(capacity, eviction_policy=policy)
    out = []
    done = 0
    for i, ids in enumerate(requests):
        out.append(serve_request(manager, [keys[b] for b in ids], ReqContext(f"req-{i}")))
        if progress is not None and i - done + 1 >= _PROGRESS_EVERY:
            progress(i - done + 1)
            done = i + 1
    if progress is not None and len(requests) > done:
        progress(len(requests) - done)
    return out


def gap_closed(value: float, lru: float, belady: float) -> float:
    """The share of the LRU -> Belady gap that ``value`` closes (NaN when there is no gap)."""
    gap = belady - lru
    return (value - lru) / gap if gap > 1e-12 else math.nan
