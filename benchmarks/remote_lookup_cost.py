"""Engine-thread cost of the remote tier's lookups against the ``small`` model's step time.

A step that looks up 1,000 blocks known remotely costs the engine thread 1,000
:meth:`RedisTier.lookup` calls (dictionary hits: the network is on the tier's threads). Measured
here, interleaved with one another, median [min..max] of ``--repeats``:

* ``known``: 1,000 lookups of blocks the tier knows the server holds (``HIT``);
* ``unknown``: 1,000 lookups of blocks never asked before (``RETRY``: queued for the lookup
  thread, one lock per key) plus, once answered, applying the 1,000 answers at the next call;
* ``step``: one engine step of the ``small`` preset (8 requests of 512 prompt tokens and 16
  output tokens, the bench's ``max_num_seqs``), median over the steps of one run.

Usage: ``python benchmarks/remote_lookup_cost.py [--url redis://...] [--repeats 9]``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Iterator

import torch

from kvoffload.engine import Engine, SamplingParams
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers.contract import KVLayout, TierJob
from kvoffload.tiers.redis.tier import RedisTier, RemoteTierConfig

N = 1000


@contextlib.contextmanager
def server_url(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from kvoffload.benchmark.redis_server import standalone_server

    with standalone_server() as server:
        yield server.url


def wait_answers(tier: RedisTier, keys: list[OffloadKey], ctx: ReqContext) -> None:
    deadline = time.monotonic() + 30
    while any(tier.lookup(k, ctx) is LookupResult.RETRY for k in keys):
        assert time.monotonic() < deadline
        time.sleep(0.001)


def small_step_times() -> list[float]:
    torch.manual_seed(0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(512)] for _ in range(8)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    steps = []
    with Engine("small", num_device_blocks=600, max_num_seqs=8) as engine:
        engine.generate([prompts[0][:64]], SamplingParams(max_tokens=2, ignore_eos=True))
        for p in prompts:
            engine.add_request(p, params)
        while engine.scheduler.has_work:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    block = 4096
    layout = KVLayout("lookup-bench", "float32", 16, 8, 4, 64, block)
    pool = torch.zeros((N, block), dtype=torch.uint8)
    view = pool.numpy().data
    known_t: list[float] = []
    unknown_t: list[float] = []
    with server_url(args.url) as url:
        writer = RedisTier(view, layout, RemoteTierConfig(url=url))
        keys = [make_offload_key(i.to_bytes(32, "big")) for i in range(N)]
        writer.submit_store(TierJob(1, keys, list(range(N))))
        writer.drain_jobs()
        assert writer.get_finished_jobs()[0].success
        writer.close()
        ctx = ReqContext("bench")
        for rep in range(args.repeats):
            tier = RedisTier(view, layout, RemoteTierConfig(url=url, lookup_wait_s=30))
            try:
                lookup = tier.lookup
                fresh = [
                    make_offload_key((10**6 * (rep + 1) + i).to_bytes(32, "big")) for i in range(N)
                ]
                start = time.perf_counter()
                for k in fresh:
                    lookup(k, ctx)
                first = time.perf_counter() - start
                tier.drain_jobs()
                time.sleep(0.05)  # let the lookup thread answer
                start = time.perf_counter()
                lookup(fresh[0], ctx)  # applies the answers
                unknown_t.append(first + time.perf_counter() - start)
                wait_answers(tier, keys, ctx)
                start = time.perf_counter()
                for k in keys:
                    lookup(k, ctx)
                known_t.append(time.perf_counter() - start)
            finally:
                tier.close()
    steps = small_step_times()
    step = statistics.median(steps)

    def show(name: str, t: list[float]) -> None:
        med = statistics.median(t)
        print(
            f"{name:28s} {med * 1e3:7.3f} ms [{min(t) * 1e3:.3f}..{max(t) * 1e3:.3f}]"
            f"  = {100 * med / step:5.2f}% of a small-model step"
        )

    print(
        f"small model step: median {step * 1e3:.1f} ms [{min(steps) * 1e3:.1f}.."
        f"{max(steps) * 1e3:.1f}] over {len(steps)} steps"
    )
    show(f"{N} lookups, known", known_t)
    show(f"{N} lookups, unknown+answers", unknown_t)


if __name__ == "__main__":
    main()
