"""Offload-tier ``BlockStored`` events describe their blocks, promoted blocks included (issue 21).

After a warm restart the host tier fills with blocks promoted from disk: no planned store
describes them, so they were announced with ``parent=- tokens=0 block_size=0``. The request
whose lookup met them on disk knows their tokens: now every host ``BlockStored`` carries them.
"""

from __future__ import annotations

from pathlib import Path

from engine_cases import (
    BLOCK_SIZE,
    EventCollector,
    cycling_rounds,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    tiny_engine,
)

from kvoffload.engine import Engine
from kvoffload.events import BlockStored

PROMPTS = cycling_rounds(num_prefixes=3, prefix_blocks=6, num_rounds=1)[0]
DISK_GIB = 64 * 8192 / 2**30  # 64 block files of the tiny preset


def _engine(path: Path, **kwargs: object) -> Engine:
    return tiny_engine(
        num_device_blocks=40,
        kv_lookup_retry_s=600.0,  # wait for every promotion, however loaded the machine
        kv_offloading_size=host_gib(16),
        kv_disk_path=str(path),
        kv_disk_size=DISK_GIB,
        **kwargs,
    )


def _serve_one_at_a_time(engine: Engine) -> list[list[int]]:
    """Each prompt alone, drained after it; return each request's whole sequence."""
    sequences = []
    for prompt in PROMPTS:
        (output,) = engine.generate([prompt], greedy(max_tokens=2))
        sequences.append(output.prompt_token_ids + output.output_token_ids)
        engine.drain()
    return sequences


def test_blocks_promoted_after_a_warm_restart_carry_their_tokens(tmp_path: Path) -> None:
    with _engine(tmp_path) as engine:
        _serve_one_at_a_time(engine)
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    with _engine(tmp_path, kv_events_config=events) as engine:
        collector = EventCollector()
        engine.publisher = collector
        sequences = _serve_one_at_a_time(engine)
        disk_hits = engine.stats()["offload_hit_tokens_disk"]
    stored = [
        event
        for batch in collector.batches
        for event in batch.events
        if isinstance(event, BlockStored) and event.medium == "CPU"
    ]
    assert disk_hits > 0 and stored  # the host tier was filled from disk
    for event in stored:
        assert event.block_size == BLOCK_SIZE
        assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
    # The tokens are the blocks' own: a block-aligned run of one of the requests' sequences.
    for event in stored:
        n = len(event.token_ids)
        assert any(
            sequence[start : start + n] == event.token_ids
            for sequence in sequences
            for start in range(0, len(sequence) - n + 1, BLOCK_SIZE)
        ), event
