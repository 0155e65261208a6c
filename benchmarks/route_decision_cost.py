"""Routing decision cost: tokenize (token ids given: none), hash the prompt's blocks, match them
against the index, choose, at 1,000 indexed prefixes per instance, while KV events keep coming.

``python benchmarks/route_decision_cost.py --instances 4 --prefixes 1000 --prompt-blocks 64``
fills a :class:`~kvoffload.routing.prefix_index.PrefixIndex` through the router's event path (msgpack
batches decoded and applied, device and host tiers), then times ``Router.rank`` (what ``kvoffload
route`` runs per request, under its lock) for prompts that share a prefix with some instance.
Between two decisions one event batch is decoded and applied (a prefix removed, another stored:
``--churn`` batches), as the router's event threads do, so the garbage collector runs as it would
in the router, not in a frozen heap. The router's startup objects are frozen as ``kvoffload route``
freezes them before serving (the index is built after, so collections see it).

Prints, as the median [min-max] over interleaved repeats: p50 / p99 microseconds per decision on
the wall clock and in thread CPU time (the CPU figure leaves out preemption by other processes,
which dominates wall-clock tails on a loaded machine), the collections that started inside a
decision (and the full ones in the whole repeat), and the CPU milliseconds of one full collection with the index loaded (the pause any
full collection in the router process costs a decision waiting on the GIL).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from array import array

import numpy as np

from kvoffload.events import BlockRemoved, BlockStored, EventDecoder, EventEncoder, KVEventBatch
from kvoffload.events.messages import ExternalBlockHash
from kvoffload.routing.policies import create_policy
from kvoffload.routing.router import BackendSpec, Router
from kvoffload.serving.prompts import PromptTokenizer


class Workload:
    """Prefixes per instance (uint32 arrays, with the serial their block hashes derive from: the
    harness keeps no lists the collector walks), their events as msgpack batches, and a rotation
    that replaces one prefix per batch."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.args, self.rng = args, rng
        self.encoder, self.decoder = EventEncoder(), EventDecoder()
        self.prefixes: list[list[tuple[array, int]]] = [[] for _ in range(args.instances)]
        self._serial = 0

    def new_prefix(self) -> array:
        n = self.args.prompt_blocks * self.args.block_size
        return array("I", (self.rng.randrange(1, 256) for _ in range(n)))

    def _hashes(
        self, instance: int, serial: int
    ) -> tuple[list[ExternalBlockHash], list[ExternalBlockHash]]:
        """The engine hashes of a prefix's device half and host half."""
        blocks = self.args.prompt_blocks
        hashes: list[ExternalBlockHash] = [(instance << 48) | (serial << 12) | k for k in range(blocks)]
        return hashes[: blocks // 2], hashes[blocks // 2 :]

    def stored(self, instance: int, tokens: array) -> list[BlockStored]:
        """A prefix's BlockStored events (first half on the device, the rest on the host)."""
        bs = self.args.block_size
        self._serial += 1
        device, host = self._hashes(instance, self._serial)
        ids = tokens.tolist()
        self.prefixes[instance].append((tokens, self._serial))
        cut = len(device) * bs
        return [BlockStored(device, None, ids[:cut], bs, None, "GPU", None),
                BlockStored(host, device[-1], ids[cut:], bs, None, "CPU", None)]

    def batch(self, events: list) -> bytes:
        return self.encoder.encode(KVEventBatch(time.time(), events))

    def rotate(self, instance: int) -> bytes:
        """One batch: the instance's oldest prefix removed, a new one stored."""
        _, serial = self.prefixes[instance].pop(0)
        device, host = self._hashes(instance, serial)
        removed = [BlockRemoved(device, "GPU"), BlockRemoved(host, "CPU")]
        return self.batch(removed + self.stored(instance, self.new_prefix()))

    def prompt(self) -> list[int]:
        bs, blocks = self.args.block_size, self.args.prompt_blocks
        tokens, _ = self.rng.choice(self.rng.choice(self.prefixes))
        head = tokens[: self.rng.randrange(8, blocks) * bs].tolist()
        return head + [self.rng.randrange(1, 256) for _ in range(40)]


def build(args: argparse.Namespace) -> tuple[Router, Workload]:
    router = Router([BackendSpec(f"http://b{i}") for i in range(args.instances)], create_policy(),
                    PromptTokenizer("tiny"), args.block_size)
    for b in router.backends:
        b.index_id = router.index.add_instance()
        b.healthy = True
    gc.collect()
    gc.freeze()  # as kvoffload route does before serving: startup objects only, no index yet
    work = Workload(args, random.Random(0))
    for i, b in enumerate(router.backends):
        for _ in range(args.prefixes):
            payload = work.batch(work.stored(i, work.new_prefix()))
            router._apply(b.index_id, work.decoder.decode(payload).events)  # type: ignore[arg-type]
    return router, work


def measure(router: Router, work: Workload, args: argparse.Namespace) -> dict[str, float]:
    """One repeat: ``decisions`` decisions, ``churn`` event batches between two of them."""
    inside = [False]
    started = {0: 0, 1: 0, 2: 0}
    full = [0]

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            full[0] += info["generation"] == 2
            started[info["generation"]] += inside[0]

    gc.callbacks.append(count)
    wall, cpu = [], []
    try:
        for n in range(args.decisions):
            for c in range(args.churn):
                b = router.backends[(n + c) % len(router.backends)]
                router._apply(b.index_id, work.decoder.decode(work.rotate(b.index_id)).events)  # type: ignore[arg-type]
            prompt = work.prompt()
            inside[0] = True
            w, t = time.perf_counter(), time.thread_time()
            router.rank(prompt, None)
            t, w = time.thread_time() - t, time.perf_counter() - w
            inside[0] = False
            wall.append(w * 1e6)
            cpu.append(t * 1e6)
    finally:
        gc.callbacks.remove(count)
    return {
        "wall_p50": float(np.percentile(wall, 50)), "wall_p99": float(np.percentile(wall, 99)),
        "cpu_p50": float(np.percentile(cpu, 50)), "cpu_p99": float(np.percentile(cpu, 99)),
        **{f"gc{g}_in_decisions": float(v) for g, v in started.items()},
        "gc2_in_run": float(full[0]),
    }


def full_collection_ms() -> float:
    start = time.thread_time()
    gc.collect()
    return (time.thread_time() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=1000, help="indexed prefixes per instance")
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--churn", type=int, default=1, help="event batches between two decisions")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    router, work = build(args)
    index = router.index
    print(f"index: {index.num_keys()} keys, {index.num_blocks()} blocks; "
          f"load average {os.getloadavg()[0]:.1f}")
    runs = [measure(router, work, args) for _ in range(args.repeats)]
    collections = [full_collection_ms() for _ in range(3)]
    for name, unit in (("wall_p50", "us"), ("wall_p99", "us"), ("cpu_p50", "us"),
                       ("cpu_p99", "us"), ("gc0_in_decisions", ""), ("gc1_in_decisions", ""),
                       ("gc2_in_decisions", ""), ("gc2_in_run", "")):
        values = [r[name] for r in runs]
        print(f"{name:<18} {np.median(values):10.1f} {unit:<2} "
              f"[{min(values):.1f}-{max(values):.1f}]")
    print(f"full collection    {np.median(collections):10.1f} ms "
          f"[{min(collections):.1f}-{max(collections):.1f}] CPU, index loaded "
          f"({len(gc.get_objects())} tracked objects outside the frozen startup)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
