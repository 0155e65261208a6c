"""A waiting request the device cannot take yet, with a hit in the host tier: the connector is
not asked again every step when no answer could make it fit, its hit is not lost to eviction
meanwhile, and asking it again is not a fresh load decision (the cost probe counts decisions).

Deterministic: copies are reported at the first collection after they finish
(:func:`~engine_cases.delay_completions` with 0), and the scenarios are laid out block by block
(:data:`~engine_cases.BLOCK_SIZE`-token blocks).
"""

from __future__ import annotations

import random
from typing import Any

from engine_cases import (
    BLOCK_SIZE,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_tokens,
    run_until_done,
    tiny_engine,
)

from kvoffload.engine import Engine
from kvoffload.scheduler.costs import PROBE_AFTER_DECLINES

#: Full blocks of the waiting request's prompt (held by the host tier).
HIT_BLOCKS = 6
#: Its prompt: the blocks and two tokens more.
PROMPT_LEN = HIT_BLOCKS * BLOCK_SIZE + 2


def _engine(**kwargs: Any) -> Engine:
    """Arrival order (A, added first, is admitted first) and an LRU host tier."""
    engine = tiny_engine(eviction_policy="lru", scheduling_policy="fcfs", **kwargs)
    delay_completions(engine, lambda _job: 0)
    return engine


def test_a_waiting_request_without_room_is_asked_once_and_keeps_its_host_hit() -> None:
    """B ran once (its blocks are in the host tier and cached in the device). Then A takes every
    other device block, and decodes into B's cached blocks one by one while B waits: no free
    block is left for B whatever the connector answers, so B is asked once, not every step. A's
    prompt blocks enter the full LRU host tier after B's ask, and A's decode blocks evict its
    least recently used blocks: B's, had B's blocks not been touched since as an ask touches
    them. Once A finishes, B loads its whole prompt from the host tier."""
    rng = random.Random(3)
    prompt_b = random_tokens(rng, PROMPT_LEN)
    prompt_a = random_tokens(rng, 18 * BLOCK_SIZE)  # 18 blocks, + 6 while decoding 24 tokens
    # Device: A's 24 blocks at its end (B's 6 cached ones among them). Host: B's 6 + A's 18
    # prompt blocks exactly; A's decode blocks evict.
    with _engine(num_device_blocks=24, kv_offloading_size=host_gib(24)) as engine:
        run_until_done(engine, [engine.add_request(prompt_b, greedy(max_tokens=1))])
        engine.drain()
        a = engine.add_request(prompt_a, greedy(max_tokens=24))
        b = engine.add_request(prompt_b, greedy(max_tokens=1))
        lookups = engine.stats()["offload_lookups"]
        done = run_until_done(engine, [a, b])
        asked = engine.stats()["offload_lookups"] - lookups
    assert done[b].cached_tokens_engine == 0  # A's decoding took all of B's device blocks
    assert done[b].cached_tokens_offload == HIT_BLOCKS * BLOCK_SIZE
    assert asked == 3  # A once; B when added and once A finished (not in the ~24 steps between)


def test_asking_a_waiting_request_again_is_not_another_load_decision() -> None:
    """A copy measured very slow makes every hit recomputed (``auto``); after
    ``PROBE_AFTER_DECLINES`` declined decisions the estimate is forgotten and the next hit
    probes it with a load. B waits ~20 steps behind A with room for 1-6 blocks but not its 7:
    it is asked every step, but that is one decision, made when it is admitted: it recomputes
    its hit (no probe is due)."""
    rng = random.Random(4)
    prompt_b = random_tokens(rng, PROMPT_LEN)
    flush = random_tokens(rng, 23 * BLOCK_SIZE + 2)  # all 24 device blocks: B's leave
    prompt_a = random_tokens(rng, 18 * BLOCK_SIZE)  # 18 blocks, + 5 while decoding 20 tokens
    options = {"num_device_blocks": 24, "kv_offloading_size": host_gib(256)}
    with _engine(load_policy="auto", **options) as engine:
        run_until_done(engine, [engine.add_request(prompt_b, greedy(max_tokens=1))])
        run_until_done(engine, [engine.add_request(flush, greedy(max_tokens=1))])
        engine.drain()
        assert engine.connector is not None
        engine.connector.costs.observe_load(1.0, 1)  # a stalled copy: 1 s a block
        a = engine.add_request(prompt_a, greedy(max_tokens=20))
        b = engine.add_request(prompt_b, greedy(max_tokens=1))
        lookups = engine.stats()["offload_lookups"]
        done = run_until_done(engine, [a, b])
        asked = engine.stats()["offload_lookups"] - lookups
        stats = engine.stats()
    assert asked > PROBE_AFTER_DECLINES + 2  # B was asked again each step while it waited
    assert done[b].cached_tokens_offload == 0
    assert stats["offload_recomputed_by_choice_tokens_host"] >= HIT_BLOCKS * BLOCK_SIZE
