"""Helpers of the remote-tier tests: host pools, layouts, and bounded waits on a tier's threads."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import numpy as np
import torch

from kvoffload import ReqContext, make_offload_key
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult
from kvoffload.tiers.contract import KVLayout, TierJob, TierJobResult
from kvoffload.tiers.redis.tier import RedisTier, RemoteTierConfig

#: Bytes of one test block (one host slot).
BLOCK_BYTES = 4096
#: Every bounded wait gives up after this many seconds.
WAIT_S = 30.0

_job_ids = itertools.count(1)


def make_layout(model: str | None = None, block_bytes: int = BLOCK_BYTES) -> KVLayout:
    """A layout whose fingerprint no other test uses (so tests never see each other's blocks)."""
    return KVLayout(model or f"test-{uuid.uuid4().hex}", "float32", 16, 2, 2, 16, block_bytes)


def make_pool(num_slots: int, block_bytes: int = BLOCK_BYTES) -> tuple[torch.Tensor, memoryview]:
    """A host pool as the engine has it: a uint8 tensor and its 2-D memoryview."""
    tensor = torch.zeros((num_slots, block_bytes), dtype=torch.uint8)
    return tensor, tensor.numpy().data


def fill_random(tensor: torch.Tensor, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tensor.numpy()[:] = rng.integers(0, 256, tensor.shape, dtype=np.uint8)


def keys_for(n: int, salt: int = 0) -> list[OffloadKey]:
    return [make_offload_key(((salt << 32) + i).to_bytes(32, "big")) for i in range(n)]


def make_tier(url: str, pool: memoryview, layout: KVLayout, **options: Any) -> RedisTier:
    options.setdefault("lookup_wait_s", WAIT_S)  # tests wait for every answer
    return RedisTier(pool, layout, RemoteTierConfig(url=url, **options), enable_events=True)


def job(keys: list[OffloadKey], slots: list[int]) -> TierJob:
    return TierJob(next(_job_ids), list(keys), list(slots))


def wait_jobs(tier: RedisTier, num_jobs: int, timeout_s: float = WAIT_S) -> list[TierJobResult]:
    """Poll :meth:`get_finished_jobs` until ``num_jobs`` results came (bounded)."""
    results: list[TierJobResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < num_jobs:
        assert time.monotonic() < deadline, f"{len(results)}/{num_jobs} jobs finished in time"
        results += tier.get_finished_jobs()
        time.sleep(0.002)
    assert len(results) == num_jobs
    return results


def run_job(
    tier: RedisTier, store: bool, keys: list[OffloadKey], slots: list[int]
) -> TierJobResult:
    """Submit one job and wait for its result."""
    submitted = job(keys, slots)
    (tier.submit_store if store else tier.submit_load)(submitted)
    (result,) = wait_jobs(tier, 1)
    assert result.job_id == submitted.job_id and result.is_store == store
    return result


def lookup_all(
    tier: RedisTier, keys: list[OffloadKey], timeout_s: float = WAIT_S
) -> list[LookupResult]:
    """Ask until no key answers RETRY (as the scheduler does, step after step; bounded)."""
    ctx = ReqContext("lookup")
    deadline = time.monotonic() + timeout_s
    while True:
        answers = [tier.lookup(key, ctx) for key in keys]
        if LookupResult.RETRY not in answers:
            return answers
        assert time.monotonic() < deadline, "lookups still RETRY"
        time.sleep(0.002)


def wait_until(predicate: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
