"""The KV that comes back from the host tier is byte for byte the KV that was computed."""

from __future__ import annotations

import random

import pytest
import torch
from engine_cases import (
    BLOCK_SIZE,
    assert_quiescent,
    backing_manager,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_tokens,
    tiny_engine,
)

from kvoffload.engine import Engine
from kvoffload.keys import make_offload_key

PREFIX_BLOCKS = 6


def _page(engine: Engine, block_id: int) -> torch.Tensor:
    """Every byte engine block ``block_id`` holds (all layers' K and V)."""
    return engine.runner.kv_cache[block_id].contiguous().view(torch.uint8).reshape(-1).clone()


def _cached_blocks(engine: Engine, prefix: list[int]) -> list[int]:
    hashes = engine.hasher.hash_blocks(prefix)
    return [b.block_id for b in engine.pool.find_cached_prefix(hashes, len(hashes))]


def _host_slots(engine: Engine, prefix: list[int], factor: int) -> list[torch.Tensor]:
    """The host slot of each offloaded block of ``prefix`` (keyed by its last engine block's hash)."""
    hashes = engine.hasher.hash_blocks(prefix)
    held = dict(backing_manager(engine).items())
    assert engine.worker is not None
    slots = engine.worker.host_pool.slots
    out = []
    for j in range(len(hashes) // factor):
        block = held[make_offload_key(hashes[(j + 1) * factor - 1], 0)]
        assert block.ref_cnt == 0  # stored, readable, not pinned
        out.append(slots[block.slot].clone())
    return out


@pytest.mark.parametrize("factor", [1, 2])
def test_loaded_kv_equals_stored_kv(factor: int) -> None:
    rng = random.Random(factor)
    prefix = random_tokens(rng, PREFIX_BLOCKS * BLOCK_SIZE)
    with tiny_engine(
        num_device_blocks=12,
        block_size_factor=factor,
        kv_offloading_size=host_gib(32, factor=factor),
    ) as engine:
        engine.generate([prefix + random_tokens(rng, 2)], greedy(2))
        engine.drain()
        first_ids = _cached_blocks(engine, prefix)
        assert len(first_ids) == PREFIX_BLOCKS
        original = [_page(engine, b) for b in first_ids]
        host = _host_slots(engine, prefix, factor)
        # A host slot is the offloaded block's engine pages back to back.
        for j, slot in enumerate(host):
            assert torch.equal(slot, torch.cat(original[j * factor : (j + 1) * factor]))

        # Unrelated prompts take the device cache; the prefix survives only in the host tier.
        for _ in range(2):
            engine.generate([random_tokens(rng, 26)], greedy(2))
            engine.drain()
        assert _cached_blocks(engine, prefix) == []

        out = engine.generate([prefix + random_tokens(rng, 3)], greedy(2))[0]
        assert out.cached_tokens_offload == PREFIX_BLOCKS * BLOCK_SIZE
        engine.drain()
        loaded_ids = _cached_blocks(engine, prefix)
        assert len(loaded_ids) == PREFIX_BLOCKS
        assert loaded_ids != first_ids  # the KV landed in other engine blocks
        for b, want in zip(loaded_ids, original, strict=True):
            assert torch.equal(_page(engine, b), want)
        for before, after in zip(host, _host_slots(engine, prefix, factor), strict=True):
            assert torch.equal(before, after)  # loading leaves the host copy as it was
        assert_quiescent(engine)
