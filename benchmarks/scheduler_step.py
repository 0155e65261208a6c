"""Per-step scheduler-side cost of offloading with many running decode requests.

Each request decodes one token per step; a new full block (and so a store) appears every
``block_size`` steps, staggered so that about 1/block_size of the requests add a block per step.
Measured per step: ``build_connector_meta`` (store planning, ``prepare_store``) plus
``update_connector_output`` (completing last step's stores). Printed as microseconds per
request-step, for short and long contexts: the cost should follow the number of requests that
add a block, not the number of blocks held.

    .venv/bin/python benchmarks/scheduler_step.py [--requests 100,1000,10000] [--steps 64]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from kvoffload import CPUOffloadingManager
from kvoffload.keys import BlockHash
from kvoffload.scheduler import (
    OffloadingConnectorScheduler,
    ScheduledRequest,
    SchedulerOffloadConfig,
    SchedulerOutput,
)
from kvoffload.transfer import TransferResult

BLOCK_SIZE = 16


@dataclass
class _Request:
    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict | None = None


def run(num_requests: int, context_tokens: int, steps: int) -> tuple[float, int]:
    """Return (µs per request-step, blocks held) for one configuration."""
    config = SchedulerOffloadConfig.single_group(BLOCK_SIZE)
    blocks_per_request = context_tokens // BLOCK_SIZE + steps // BLOCK_SIZE + 2
    manager = CPUOffloadingManager(num_requests * blocks_per_request + 16)
    connector = OffloadingConnectorScheduler(config, manager)
    requests: list[_Request] = []
    scheduled: list[ScheduledRequest] = []
    next_block = 0
    for i in range(num_requests):
        # Stagger: request i is (i % BLOCK_SIZE) tokens into its current block.
        n = context_tokens + i % BLOCK_SIZE
        req = _Request(f"r{i}", n, context_tokens, 0)
        req.block_hashes = [
            BlockHash(i.to_bytes(4, "big") + b.to_bytes(4, "big")) for b in range(n // BLOCK_SIZE)
        ]
        connector.get_num_new_matched_tokens(req, 0)
        num_blocks = -(-n // BLOCK_SIZE)
        connector.update_state_after_alloc(
            req, [list(range(next_block, next_block + num_blocks))], 0
        )
        next_block += num_blocks
        requests.append(req)
        scheduled.append(ScheduledRequest(req, n))
    # Prefill step: stores every full block of every request (not measured).
    meta = connector.build_connector_meta(SchedulerOutput(scheduled))
    connector.update_connector_output([TransferResult(j.job_id, True) for j in meta.store_jobs])
    for req in requests:
        req.num_computed_tokens = req.num_tokens

    pending: list[TransferResult] = []
    elapsed = 0.0
    no_new_blocks: list[list[int]] = [[]]
    for _ in range(steps):
        # Engine side (not measured): each request decodes one token.
        step_scheduled = []
        for req in requests:
            new_ids = no_new_blocks
            if req.num_tokens % BLOCK_SIZE == 0:
                new_ids = [[next_block]]
                next_block += 1
            req.num_tokens += 1
            if req.num_tokens % BLOCK_SIZE == 0:
                b = len(req.block_hashes)
                req.block_hashes.append(BlockHash(req.request_id.encode() + b.to_bytes(4, "big")))
            step_scheduled.append(ScheduledRequest(req, 1, new_ids))
        output = SchedulerOutput(step_scheduled)
        t0 = time.perf_counter()
        connector.update_connector_output(pending)
        meta = connector.build_connector_meta(output)
        elapsed += time.perf_counter() - t0
        pending = [TransferResult(j.job_id, True) for j in meta.store_jobs]
        for req in requests:
            req.num_computed_tokens = req.num_tokens - 1
    return elapsed / (steps * num_requests) * 1e6, manager.stats()["used_blocks"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", default="100,1000,10000", help="comma-separated running request counts"
    )
    parser.add_argument(
        "--steps", type=int, default=64, help="decode steps measured per configuration"
    )
    args = parser.parse_args()
    print(f"{'requests':>9} {'context':>8} {'blocks held':>12} {'us/request-step':>16}")
    for n in (int(x) for x in args.requests.split(",")):
        for context in (256, 4096):
            us, held = run(n, context, args.steps)
            print(f"{n:>9} {context:>8} {held:>12} {us:>16.2f}")


if __name__ == "__main__":
    main()
