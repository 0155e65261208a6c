"""A disk hit's cost to its request in the reference engine: engine steps and wall time from
adding the request to its first token, for a prefix held on disk only, with the lookup waiting
for the promotion (``--kv-promotion-wait-s``, the default) and without (0: the hit answers
``RETRY``, is promoted, and loads a step later, as before the wait existed).

Each prompt runs alone; the host tier holds under two prompts, so the measured prompt's blocks
come back from disk. Rounds alternate the two settings (interleaved, fresh engines and disk
directories each round) and the medians are printed with [min-max].

    .venv/bin/python benchmarks/disk_hit_steps.py --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from kvoffload.engine import Engine, SamplingParams

BLOCK_SIZE = 16
PREFIX_BLOCKS = 24


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE + 2)]


def _first_token(engine: Engine, prompt: list[int]) -> tuple[int, float]:
    """Steps and seconds from adding ``prompt`` to its first token; then drain."""
    start = time.perf_counter()
    req_id = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    for step in range(1, 1000):
        engine.step()
        live = engine.live_output(req_id)
        if live is None or live[0]:
            seconds = time.perf_counter() - start
            engine.drain()
            return step, seconds
    raise RuntimeError("no first token after 1000 steps")


def measure(wait_s: float, seed: int, model: str) -> tuple[int, float]:
    """One disk hit's steps and seconds with ``kv_promotion_wait_s=wait_s``."""
    rng = random.Random(seed)
    first, others = _prompt(rng), [_prompt(rng) for _ in range(3)]
    with tempfile.TemporaryDirectory(prefix="kvo-disk-hit-") as path:
        with Engine(model, block_size=BLOCK_SIZE, num_device_blocks=8) as probe:
            per_block = probe.model_config.kv_bytes_per_token(4) * BLOCK_SIZE  # float32 on CPU
        host_gib = (2 * PREFIX_BLOCKS - 6) * per_block / 2**30  # under two prompts
        with Engine(
            model,
            block_size=BLOCK_SIZE,
            num_device_blocks=PREFIX_BLOCKS + 4,
            max_num_seqs=1,
            kv_offloading_size=host_gib,
            eviction_policy="lru",
            kv_disk_path=path,
            kv_disk_size=0.5,
            kv_lookup_retry_s=600.0,
            kv_promotion_wait_s=wait_s,
        ) as engine:
            _first_token(engine, first)  # computed; lands in the host and on disk
            for prompt in others:  # pushes the first prompt out of the device and the host
                _first_token(engine, prompt)
            before = engine.stats()["offload_tier_promoted_blocks"]
            steps, seconds = _first_token(engine, first)
            if engine.stats()["offload_tier_promoted_blocks"] == before:
                raise RuntimeError("the measured prompt was not a disk hit")
            return steps, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--wait-s", type=float, default=0.02, help="the waiting setting")
    args = parser.parse_args()
    results: dict[float, list[tuple[int, float]]] = {0.0: [], args.wait_s: []}
    for r in range(args.rounds):
        for wait_s in (0.0, args.wait_s) if r % 2 == 0 else (args.wait_s, 0.0):
            results[wait_s].append(measure(wait_s, seed=r, model=args.model))
    print(
        f"disk hit, {PREFIX_BLOCKS} blocks of {BLOCK_SIZE} tokens, model {args.model}, "
        f"{args.rounds} interleaved rounds: steps and ms from add_request to first token"
    )
    for wait_s, runs in results.items():
        steps = [s for s, _ in runs]
        ms = [1000 * t for _, t in runs]
        print(
            f"  kv_promotion_wait_s={wait_s:<5g} steps {statistics.median(steps):g} "
            f"[{min(steps)}-{max(steps)}]  latency {statistics.median(ms):.1f} ms "
            f"[{min(ms):.1f}-{max(ms):.1f}]"
        )


if __name__ == "__main__":
    main()
