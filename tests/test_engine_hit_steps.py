"""How many engine steps an offloaded hit costs its request, step by step and deterministic:
the worker's copies are reported at the first collection after they finish
(:func:`~engine_cases.delay_completions` with 0), and a disk promotion is waited for before the
next step (the tier's ``drain_jobs``), as one that lands during the forward pass would be.

A host hit is loaded in the step that admits the request and computed in the next one. So is a
disk hit: its lookup pass answers ``RETRY``, the scheduler submits the promotion at once and
waits for it (``kv_promotion_wait_s``; here long enough for any loaded machine, so the outcome
never depends on timing), and the second pass loads it in the same step. Without the wait
(``kv_promotion_wait_s=0``) the disk hit is answered ``RETRY`` in the step that admits it, loaded
in the next and computed in the one after: exactly one step more, and no second ``RETRY``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_cases import (
    BLOCK_SIZE,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_tokens,
    tiny_engine,
)

from kvoffload.engine import Engine

PREFIX_BLOCKS = 6


def _prompt(rng: random.Random) -> list[int]:
    return random_tokens(rng, PREFIX_BLOCKS * BLOCK_SIZE + 2)


def _steps_to_first_token(engine: Engine, prompt: list[int], drain_tier: bool) -> int:
    """Steps from adding ``prompt`` (alone) to its first computed token; ``drain_tier``: wait for
    the disk tier's jobs after each step."""
    req_id = engine.add_request(prompt, greedy(max_tokens=2))
    for step in range(1, 20):
        engine.step()
        if drain_tier:
            for tier in engine.tiering.tiers:  # type: ignore[union-attr]
                tier.drain_jobs()
        live = engine.live_output(req_id)
        if live is None or live[0]:
            engine.drain()
            return step
    raise AssertionError("no token after 20 steps")


@pytest.mark.parametrize(
    ("promotion_wait_s", "disk_steps", "retries"),
    [(60.0, 2, 0), (0.0, 3, 1)],
    ids=["one-step", "without-the-wait"],
)
def test_a_disk_hit_costs_the_steps_of_a_host_hit(
    tmp_path: Path, promotion_wait_s: float, disk_steps: int, retries: int
) -> None:
    rng = random.Random(5)
    first, others = _prompt(rng), [_prompt(rng) for _ in range(3)]
    with tiny_engine(
        num_device_blocks=10,  # one prompt at a time; each next prompt evicts the last
        max_num_seqs=1,
        kv_offloading_size=host_gib(12),  # under two prompts' blocks
        eviction_policy="lru",
        kv_disk_path=str(tmp_path),
        kv_disk_size=0.01,
        kv_lookup_retry_s=600.0,
        kv_promotion_wait_s=promotion_wait_s,
    ) as engine:
        delay_completions(engine, lambda _job: 0)
        # Computed: no hit of any kind. The first prompt lands in the host tier and on disk.
        cold = _steps_to_first_token(engine, first, drain_tier=True)
        # A host hit: out of the device (evicted by the next prompt), still in the host.
        _steps_to_first_token(engine, others[0], drain_tier=True)
        before = engine.stats()
        host = _steps_to_first_token(engine, first, drain_tier=True)
        after = engine.stats()
        assert after["offload_hit_tokens_host"] > before.get("offload_hit_tokens_host", 0)
        assert after["offload_retries"] == before["offload_retries"]
        # A disk hit: two more prompts push the first out of the host; the disk still has it.
        for prompt in others[1:]:
            _steps_to_first_token(engine, prompt, drain_tier=True)
        before = engine.stats()
        disk = _steps_to_first_token(engine, first, drain_tier=True)
        after = engine.stats()
        assert after["offload_tier_promoted_blocks"] > before["offload_tier_promoted_blocks"]
        assert after["offload_hit_tokens_disk"] > before.get("offload_hit_tokens_disk", 0)
        assert after["offload_retries"] == before["offload_retries"] + retries
        landed = after["offload_tier_awaited_promotions_landed"]
        assert landed - before["offload_tier_awaited_promotions_landed"] == 1 - retries
    assert (cold, host, disk) == (1, 2, disk_steps)
