"""Routing decision cost: tokenize (token ids given: none), hash the prompt's blocks, match them
against the index, choose, at 1,000 indexed prefixes per instance.

``python benchmarks/route_decision_cost.py --instances 4 --prefixes 1000 --prompt-blocks 64``
fills a :class:`~kvoffload.routing.index.PrefixIndex` with the BlockStored events of 1,000
prefixes per instance (device and host tiers), then times ``Router.rank`` (what ``kvoffload
route`` runs per request, under its lock) for prompts that share a prefix with some instance,
and prints p50 / p99 microseconds as the median [min-max] over interleaved repeats.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import numpy as np

from kvoffload.events import BlockStored
from kvoffload.routing.policies import Policy
from kvoffload.routing.router import BackendSpec, Router
from kvoffload.serving.prompts import PromptTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=1000)
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bs, rng = args.block_size, random.Random(0)
    router = Router([BackendSpec(f"http://b{i}") for i in range(args.instances)], Policy(),
                    PromptTokenizer("tiny"), bs)
    prefixes = [[rng.randrange(1, 256) for _ in range(args.prompt_blocks * bs)]
                for _ in range(args.prefixes * args.instances)]
    for i, b in enumerate(router.backends):
        b.index_id = router.index.add_instance()
        b.healthy = True
        for n, tokens in enumerate(prefixes[i :: args.instances]):
            hashes = [(i << 40) | (n << 12) | k for k in range(args.prompt_blocks)]
            half = args.prompt_blocks // 2
            router.index.apply(b.index_id, [
                BlockStored(hashes[:half], None, tokens[: half * bs], bs, None, "GPU", None),
                BlockStored(hashes[half:], hashes[half - 1], tokens[half * bs :], bs, None, "CPU",
                            None)])
    print(f"index: {router.index.num_keys()} keys, {router.index.num_blocks()} blocks")
    prompts = [rng.choice(prefixes)[: rng.randrange(8, args.prompt_blocks) * bs] +
               [rng.randrange(1, 256) for _ in range(40)] for _ in range(args.decisions)]
    gc.collect()
    gc.freeze()  # the harness's own prompt lists are not the router's: keep them out of GC pauses
    p50s, p99s = [], []
    for _ in range(args.repeats):
        times = []
        for prompt in prompts:
            start = time.perf_counter()
            router.rank(prompt, None)
            times.append((time.perf_counter() - start) * 1e6)
        p50s.append(np.percentile(times, 50))
        p99s.append(np.percentile(times, 99))
    for name, values in (("p50", p50s), ("p99", p99s)):
        print(f"decision {name}: {np.median(values):.1f} us [{min(values):.1f}-{max(values):.1f}]")


if __name__ == "__main__":
    main()
