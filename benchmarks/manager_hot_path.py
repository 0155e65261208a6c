"""Scheduler-side cost per block of CPUOffloadingManager with each eviction policy.

Usage::

    .venv/bin/python benchmarks/manager_hot_path.py [--requests 3000] [--zipf-requests 3000]
        [--repeats 5] [--policies lru,adaptive]

Two fixed-seed streams of requests of 32 blocks, each served exactly as a scheduler would:
``lookup`` until the first miss, ``prepare_load``/``complete_load`` the hits, ``touch`` all keys,
``prepare_store``/``complete_store`` the rest, ``take_events``, ``request_finished``.

``prefixes``
    Each request continues one of 200 shared prefix chains (Zipf-like popularity, weight
    1/rank) for 8 to 32 blocks and fills the rest with blocks of its own. The tier holds half of
    the stream's distinct blocks.
``zipf``
    Each request continues one of 1,000 chains of 32 blocks (weight 1/rank) for 0 to 32 blocks,
    the rest its own, at 2,000 slots: a tier far smaller than the working set, so nearly every
    request evicts (the stream of issue 12).

The ``prefixes`` stream also runs through a bare ``OrderedDict`` LRU doing the same hits,
recency updates and inserts with no contract at all: the floor a Python manager can approach.
Keys and request contexts are built before the clock starts. Every loop runs once per repeat,
interleaved (A B C, A B C, ...), so that machine load hits all alike; figures are the median
microseconds per request block over ``--repeats``, with the min-max spread.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffload.eviction import available_eviction_policies
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.replay import serve_request

BLOCKS_PER_REQUEST = 32
NUM_PREFIXES = 200
SEED = 0
ZIPF_CHAINS = 1_000
ZIPF_SLOTS = 2_000


def make_stream(
    num_requests: int, num_prefixes: int = NUM_PREFIXES, min_shared: int = 8, name: str = "prefix"
) -> list[list[OffloadKey]]:
    rng = random.Random(f"{name}:{SEED}")
    weights = [1.0 / rank for rank in range(1, num_prefixes + 1)]
    prefixes = [
        [make_offload_key(f"{name}-{p}-{i}".encode()) for i in range(BLOCKS_PER_REQUEST)]
        for p in range(num_prefixes)
    ]
    stream = []
    for r in range(num_requests):
        shared = rng.randint(min_shared, BLOCKS_PER_REQUEST)
        chain = rng.choices(prefixes, weights)[0][:shared]
        chain += [
            make_offload_key(f"{name}-req-{r}-{i}".encode())
            for i in range(shared, BLOCKS_PER_REQUEST)
        ]
        stream.append(chain)
    return stream


def run_manager(
    stream: Sequence[Sequence[OffloadKey]], policy: str, capacity: int
) -> tuple[float, float]:
    """Seconds for the whole stream, and its block-level hit ratio."""
    manager = CPUOffloadingManager(capacity, eviction_policy=policy, enable_events=True)
    contexts = [ReqContext(f"req-{i}") for i in range(len(stream))]
    hits = 0
    start = time.perf_counter()
    for keys, ctx in zip(stream, contexts, strict=True):
        hits += serve_request(manager, keys, ctx)
    elapsed = time.perf_counter() - start
    manager.check_invariants()
    return elapsed, hits / (len(stream) * BLOCKS_PER_REQUEST)


def run_bare_lru(stream: Sequence[Sequence[OffloadKey]], capacity: int) -> tuple[float, float]:
    """The same hits, recency updates and inserts on one OrderedDict, no contract."""
    cache: OrderedDict[OffloadKey, bool] = OrderedDict()
    move, pop = cache.move_to_end, cache.popitem
    hits = 0
    start = time.perf_counter()
    for keys in stream:
        n = 0
        for key in keys:
            if key not in cache:
                break
            n += 1
        for key in reversed(keys):
            if key in cache:
                move(key)
        for key in keys[n:]:
            if key not in cache:
                if len(cache) >= capacity:
                    pop(last=False)
                cache[key] = True
        hits += n
    elapsed = time.perf_counter() - start
    return elapsed, hits / (len(stream) * BLOCKS_PER_REQUEST)


def median_of(
    repeats: int, loops: dict[str, Callable[[], tuple[float, float]]]
) -> dict[str, tuple[list[float], float]]:
    """Run every loop once per repeat, interleaved; per loop the seconds of each run and its hit
    ratio (the same every run)."""
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    hits: dict[str, float] = {}
    for _ in range(repeats):
        for name, loop in loops.items():
            elapsed, hits[name] = loop()
            seconds[name].append(elapsed)
    return {name: (seconds[name], hits[name]) for name in loops}


def report(
    title: str, results: dict[str, tuple[list[float], float]], n_blocks: int, base: str
) -> None:
    print(title)
    print(f"{'loop':<14}{'us/block':>10}{'min-max':>16}{'x ' + base:>12}{'hit ratio':>11}")
    base_us = statistics.median(results[base][0]) / n_blocks * 1e6
    for name, (seconds, hit_ratio) in results.items():
        us = [s / n_blocks * 1e6 for s in seconds]
        med = statistics.median(us)
        spread = f"{min(us):.3f}-{max(us):.3f}"
        print(f"{name:<14}{med:>10.3f}{spread:>16}{med / base_us:>12.2f}{hit_ratio:>11.4f}")
    print()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--zipf-requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--policies", default=None, help="comma-separated (default: all registered)"
    )
    args = parser.parse_args(argv)
    policies = args.policies.split(",") if args.policies else available_eviction_policies()
    print(f"median of {args.repeats} interleaved runs\n")

    stream = make_stream(args.requests)
    capacity = len({key for keys in stream for key in keys}) // 2
    loops: dict[str, Callable[[], tuple[float, float]]] = {
        "bare LRU": lambda: run_bare_lru(stream, capacity)
    }
    for name in policies:
        loops[name] = partial(run_manager, stream, name, capacity)
    report(
        f"prefixes: {len(stream)} requests x {BLOCKS_PER_REQUEST} blocks, tier {capacity} blocks",
        median_of(args.repeats, loops),
        len(stream) * BLOCKS_PER_REQUEST,
        "bare LRU",
    )

    zipf = make_stream(args.zipf_requests, ZIPF_CHAINS, 0, "zipf")
    zipf_loops: dict[str, Callable[[], tuple[float, float]]] = {
        name: partial(run_manager, zipf, name, ZIPF_SLOTS) for name in policies
    }
    base = "lru" if "lru" in policies else policies[0]
    report(
        f"zipf: {len(zipf)} requests x {BLOCKS_PER_REQUEST} blocks over {ZIPF_CHAINS} chains, "
        f"tier {ZIPF_SLOTS} blocks",
        median_of(args.repeats, zipf_loops),
        len(zipf) * BLOCKS_PER_REQUEST,
        base,
    )


if __name__ == "__main__":
    main()
