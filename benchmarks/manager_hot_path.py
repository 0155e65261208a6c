"""Scheduler-side cost per block of CPUOffloadingManager with each eviction policy.

Usage::

    .venv/bin/python benchmarks/manager_hot_path.py [--requests 3000] [--repeats 5]

A fixed-seed stream of requests of 32 blocks: each request continues one of 200 shared prefix
chains (chosen with Zipf-like popularity, weight 1/rank) for 8 to 32 blocks and fills the rest
with blocks of its own. Per request, exactly as a scheduler would: ``lookup`` until the first
miss, ``prepare_load``/``complete_load`` the hits, ``touch`` all keys, ``prepare_store``/
``complete_store`` the rest, ``take_events``, ``request_finished``. The tier holds half of the
stream's distinct blocks, so it evicts. The same stream also runs through a bare
``OrderedDict`` LRU that does the same hits, recency updates and inserts with no contract at
all: the floor a Python manager can approach. Keys and request contexts are built before the
clock starts. Figures: best of ``--repeats`` runs, microseconds per request block.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffload.base import ReqContext
from kvoffload.benchmark.replay import serve_request
from kvoffload.eviction import available_eviction_policies
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.managers import CPUOffloadingManager

BLOCKS_PER_REQUEST = 32
NUM_PREFIXES = 200
SEED = 0


def make_stream(num_requests: int) -> list[list[OffloadKey]]:
    rng = random.Random(SEED)
    weights = [1.0 / rank for rank in range(1, NUM_PREFIXES + 1)]
    prefixes = [
        [make_offload_key(f"prefix-{p}-{i}".encode()) for i in range(BLOCKS_PER_REQUEST)]
        for p in range(NUM_PREFIXES)
    ]
    stream = []
    for r in range(num_requests):
        shared = rng.randint(8, BLOCKS_PER_REQUEST)
        chain = rng.choices(prefixes, weights)[0][:shared]
        chain += [
            make_offload_key(f"req-{r}-{i}".encode()) for i in range(shared, BLOCKS_PER_REQUEST)
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


def best_of(repeats: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    results = [run() for _ in range(repeats)]
    return min(r[0] for r in results), results[0][1]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--policies", default=None, help="comma-separated (default: all registered)"
    )
    args = parser.parse_args(argv)

    stream = make_stream(args.requests)
    distinct = len({key for keys in stream for key in keys})
    capacity = distinct // 2
    n_blocks = len(stream) * BLOCKS_PER_REQUEST
    policies = args.policies.split(",") if args.policies else available_eviction_policies()
    print(
        f"{len(stream)} requests x {BLOCKS_PER_REQUEST} blocks, {distinct} distinct, tier {capacity} blocks;"
    )
    print(f"best of {args.repeats} runs\n")
    print(f"{'loop':<14}{'us/block':>10}{'x bare':>9}{'hit ratio':>11}")
    bare_s, bare_hits = best_of(args.repeats, lambda: run_bare_lru(stream, capacity))
    bare_us = bare_s / n_blocks * 1e6
    print(f"{'bare LRU':<14}{bare_us:>10.3f}{1.0:>9.2f}{bare_hits:>11.4f}")
    for name in policies:
        seconds, hit_ratio = best_of(
            args.repeats, lambda name=name: run_manager(stream, name, capacity)
        )
        us = seconds / n_blocks * 1e6
        print(f"{name:<14}{us:>10.3f}{us / bare_us:>9.2f}{hit_ratio:>11.4f}")


if __name__ == "__main__":
    main()
