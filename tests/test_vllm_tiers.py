"""Our disk tier inside vLLM 0.33's own ``TieringOffloadingManager`` (no GPU).

The manager is built exactly as vLLM builds it: ``OffloadingSpecFactory.create_spec`` on an
``OffloadingConfig`` whose ``kv_connector_extra_config`` names ``TieringOffloadingSpec`` and our
tier by ``type`` + ``module_path``; ``spec.get_manager()`` then creates vLLM's shared-memory CPU
pool and our tier on its ``memoryview``. The GPU->CPU copy that vLLM's worker would do is done by
writing the pool at the chunk ids ``prepare_store`` returns; the CPU->GPU copy by reading them.
Steps follow vLLM's scheduler: completions are applied at a step's first lookup/prepare_store or
at ``on_schedule_end``; our tier's I/O threads are waited for with ``drain_jobs`` (deterministic).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_cases import offloading_config, require_vllm, vllm_keys

require_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402

from kvoffload.errors import ConfigError  # noqa: E402
from kvoffload.integrations.vllm.tiers import METRIC_PREFIX, KVOffloadTier  # noqa: E402

CHUNK = 4096
NUM_CHUNKS = 8
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def tiering_config(tier: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` of vLLM's tiering spec with one of our tiers behind it."""
    return {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}


def disk_tier(path: Path, **options: Any) -> dict[str, Any]:
    return {
        "type": "KVOffloadDiskTier",
        "module_path": "kvoffload.integrations.vllm.tiers",
        "path": str(path),
        "size_gib": 0.01,
        "rescan_interval": 0,
        **options,
    }


def redis_tier(url: str, **options: Any) -> dict[str, Any]:
    return {
        "type": "KVOffloadRedisTier",
        "module_path": "kvoffload.integrations.vllm.tiers",
        "url": url,
        **options,
    }


class Harness:
    """vLLM's tiering manager with our disk tier, plus the stand-in for vLLM's GPU worker."""

    def __init__(self, tier: dict[str, Any], enable_events: bool = True) -> None:
        config = offloading_config(
            tiering_config(tier),
            num_chunks=NUM_CHUNKS,
            chunk_bytes=CHUNK,
            enable_events=enable_events,
        )
        self.spec = OffloadingSpecFactory.create_spec(config)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (adapter,) = manager.secondary_tiers
        assert isinstance(adapter, KVOffloadTier)
        self.tier = adapter
        self.pool = np.asarray(manager.primary_tier.get_kv_memoryview())
        assert self.pool.shape[0] == NUM_CHUNKS and self.pool.strides[0] == CHUNK
        self._requests = 0

    def new_request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def end_step(self) -> None:
        """Wait for our tier's I/O, then end the scheduler step (cascades and promotions apply)."""
        self.tier.drain_jobs()
        self.manager.on_schedule_end(STEP_END)

    def store(self, keys: list[OffloadKey], payloads: Mapping[OffloadKey, np.ndarray]) -> None:
        """One request computes ``keys``: GPU->CPU store (bytes written), cascade to disk."""
        ctx = self.new_request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.pool[chunk] = payloads[key]
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.end_step()  # the cascade is submitted: wait for it, release the CPU chunks
        self.end_step()

    def lookup_until_settled(
        self, key: OffloadKey, ctx: ReqContext, steps: int = 4
    ) -> LookupResult:
        """Look ``key`` up step after step while it is being promoted (as vLLM's scheduler).

        ``RETRY`` (a remote lookup still running on the tier's thread) does not count as a step:
        it is asked again after a pause, for at most a minute.
        """
        deadline = time.monotonic() + 60
        while True:
            result = self.manager.lookup(key, ctx)
            if result is LookupResult.RETRY and time.monotonic() < deadline:
                time.sleep(0.005)
                self.end_step()
                continue
            if result is not LookupResult.HIT_PENDING or steps == 0:
                return result
            steps -= 1
            self.end_step()

    def load(self, keys: list[OffloadKey], ctx: ReqContext) -> list[bytes]:
        """CPU->GPU load of ``keys`` (all HIT): their bytes, read from the pool."""
        spec = self.manager.prepare_load(keys, ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        data = [self.pool[chunk].tobytes() for chunk in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return data

    def close(self) -> None:
        del self.pool  # vLLM's shutdown unmaps the pool: no export may outlive it
        self.manager.shutdown()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(disk_tier(tmp_path / "kv"))
    yield h
    h.close()


def payloads_for(keys: list[OffloadKey], seed: int) -> dict[OffloadKey, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-128, 128, CHUNK, dtype=np.int8) for k in keys}


def evict_from_cpu(h: Harness, start: int) -> None:
    """Store NUM_CHUNKS other keys: every earlier chunk leaves vLLM's CPU tier."""
    others = vllm_keys(NUM_CHUNKS, start=start)
    h.store(others, payloads_for(others, seed=start))


def disk_file(root: Path, key: bytes) -> Path:
    (path,) = root.rglob(key.hex() + "*")
    return path


def test_stores_cascade_to_disk_and_promotion_returns_the_bytes(harness: Harness) -> None:
    keys = vllm_keys(4)
    payloads = payloads_for(keys, seed=1)
    harness.store(keys, payloads)
    assert harness.tier.tier.stats()["stored_blocks"] == 4  # cascaded into our tier

    evict_from_cpu(harness, start=100)
    ctx = harness.new_request()
    assert harness.manager.primary_tier.lookup(keys[0], ctx) is LookupResult.MISS
    # vLLM's answer while our tier promotes the chunk: HIT_PENDING, then HIT.
    assert harness.manager.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
    assert harness.lookup_until_settled(keys[0], ctx) is LookupResult.HIT
    results = [harness.lookup_until_settled(k, ctx) for k in keys]
    assert results == [LookupResult.HIT] * 4
    assert harness.load(keys, ctx) == [payloads[k].tobytes() for k in keys]
    assert harness.tier.tier.stats()["loaded_blocks"] == 4


def test_a_lossless_disk_tier_promotes_the_exact_bytes(tmp_path: Path) -> None:
    """``compression: lossless`` in the tier's options: smaller files, the same bytes back."""
    h = Harness(disk_tier(tmp_path / "kv", compression="lossless"))
    try:
        keys = vllm_keys(4)
        payloads = {k: np.tile(np.arange(64, dtype=np.int8), CHUNK // 64) for k in keys}
        h.store(keys, payloads)
        evict_from_cpu(h, start=100)
        ctx = h.new_request()
        assert [h.lookup_until_settled(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        assert h.load(keys, ctx) == [payloads[k].tobytes() for k in keys]
        stats = h.tier.tier.stats()
        assert stats["codec_decoded_blocks"] == 4
        assert stats["codec_stored_bytes"] < stats["codec_raw_bytes"]
    finally:
        h.close()


def test_corrupt_block_fails_its_promotion_cleanly(harness: Harness, tmp_path: Path) -> None:
    keys = vllm_keys(2)
    payloads = payloads_for(keys, seed=2)
    harness.store(keys, payloads)
    evict_from_cpu(harness, start=200)
    bad = disk_file(tmp_path / "kv", keys[1])
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # one payload bit: only the checksum can tell
    bad.write_bytes(bytes(data))

    ctx = harness.new_request()
    assert harness.lookup_until_settled(keys[0], ctx) is LookupResult.HIT
    assert harness.load([keys[0]], ctx) == [payloads[keys[0]].tobytes()]
    # The corrupt chunk: promoted, failed, freed in the CPU tier, gone from ours: a MISS (recompute).
    assert harness.lookup_until_settled(keys[1], ctx) is LookupResult.MISS
    assert harness.manager.lookup(keys[1], ctx) is LookupResult.MISS
    stats = harness.tier.tier.stats()
    assert stats["failed_load_checksum"] == 1
    assert not bad.exists()


def test_vanished_block_fails_its_promotion_cleanly(harness: Harness, tmp_path: Path) -> None:
    keys = vllm_keys(3)
    harness.store(keys, payloads_for(keys, seed=3))
    evict_from_cpu(harness, start=300)
    disk_file(tmp_path / "kv", keys[2]).unlink()  # another process evicted it

    ctx = harness.new_request()
    assert harness.manager.lookup(keys[2], ctx) is LookupResult.HIT_PENDING  # our index says HIT
    assert harness.lookup_until_settled(keys[2], ctx) is LookupResult.MISS
    assert harness.tier.tier.stats()["failed_load_missing"] == 1
    # The promotion's CPU chunk was released: a full tier of new stores still fits.
    evict_from_cpu(harness, start=400)


def test_events_and_stats_come_out_in_vllm_types(harness: Harness) -> None:
    keys = vllm_keys(2)
    harness.store(keys, payloads_for(keys, seed=4))
    events = list(harness.manager.take_events())
    storage = [e for e in events if e.medium is Medium.STORAGE]
    assert storage and all(e.locality is Locality.LOCAL for e in storage)
    assert all(e.ownership == "KVOffloadDiskTier" for e in storage)
    assert {k for e in storage if not e.removed for k in e.keys} == set(keys)
    assert any(e.medium is Medium.CPU and not e.removed for e in events)

    evict_from_cpu(harness, start=500)
    ctx = harness.new_request()
    harness.lookup_until_settled(keys[0], ctx)
    stats = harness.manager.get_stats()
    assert stats is not None
    values = stats.reduce()
    assert any(name.startswith(METRIC_PREFIX + "stored_blocks") for name in values), values
    assert any(TieringOffloadingMetrics.READ_BYTES in name for name in values), values
    # The counters are increments: a second call without new work adds nothing.
    again = harness.manager.get_stats()
    reduced = again.reduce() if again is not None else {}
    assert not any(
        name.startswith(METRIC_PREFIX + "stored_blocks") and value
        for name, value in reduced.items()
    )


def test_metric_definitions_cover_what_the_tier_reports(harness: Harness) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    definitions = TieringOffloadingSpec.build_metric_definitions(dict(harness.spec.extra_config))
    keys = vllm_keys(1)
    harness.store(keys, payloads_for(keys, seed=5))
    stats = harness.tier.get_stats()
    # 0.33 names the sections; 0.32 keeps the same two dicts without the accessor
    sections = (
        stats.metric_sections()
        if hasattr(stats, "metric_sections")
        else (stats._types, stats._values)
    )
    for section in sections:
        for name in section:
            if name.startswith(METRIC_PREFIX):
                assert name in definitions


def test_events_disabled_keeps_no_tier_events(tmp_path: Path) -> None:
    h = Harness(disk_tier(tmp_path / "kv"), enable_events=False)
    try:
        keys = vllm_keys(2)
        h.store(keys, payloads_for(keys, seed=6))
        assert h.tier.tier.take_events() == []
    finally:
        h.close()


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"size_gib": -1}, "secondary_tiers.size_gib"),
        ({"size_gib": 1e-9}, "secondary_tiers.size_gib"),
        ({"colour": "red"}, "secondary_tiers.colour"),
        ({"compression": "gzip"}, "secondary_tiers.compression"),
        ({"compression": "fp8"}, "secondary_tiers.compression"),  # no head size in vLLM's layout
    ],
)
def test_bad_tier_options_are_config_errors(
    tmp_path: Path, options: dict[str, Any], setting: str
) -> None:
    config = offloading_config(tiering_config(disk_tier(tmp_path / "kv", **options)), num_chunks=4)
    spec = OffloadingSpecFactory.create_spec(config)
    with pytest.raises(ConfigError) as info:
        spec.get_manager()
    assert info.value.field == setting


# -- our Redis tier: shared by engines on different machines ---------------------------------------


def test_redis_tier_shares_blocks_between_two_vllm_engines(redis_server: Any) -> None:
    # lookup_wait_s: a remote answer is waited for (RETRY) rather than taken as a MISS for now.
    producer = Harness(redis_tier(redis_server.url, lookup_wait_s=60.0))
    consumer = Harness(redis_tier(redis_server.url, lookup_wait_s=60.0))
    try:
        keys = vllm_keys(3, start=1000)
        payloads = payloads_for(keys, seed=7)
        producer.store(keys, payloads)
        assert producer.tier.tier.stats()["stored_blocks"] == 3

        ctx = consumer.new_request()
        assert [consumer.lookup_until_settled(k, ctx) for k in keys] == [LookupResult.HIT] * 3
        assert consumer.load(keys, ctx) == [payloads[k].tobytes() for k in keys]
        storage = [e for e in consumer.manager.take_events() if e.medium is Medium.STORAGE]
        assert all(e.locality is Locality.REMOTE for e in storage)
    finally:
        producer.close()
        consumer.close()


def test_redis_block_that_vanished_fails_its_promotion_cleanly(redis_server: Any) -> None:
    from kvoffload.tiers.redis.tier import remote_key_prefix

    h = Harness(redis_tier(redis_server.url, lookup_wait_s=60.0))
    try:
        keys = vllm_keys(2, start=2000)
        payloads = payloads_for(keys, seed=8)
        h.store(keys, payloads)
        evict_from_cpu(h, start=2100)
        with redis_server.client() as client:  # the server evicted it (maxmemory, TTL, FLUSHDB)
            assert client.delete(remote_key_prefix(h.tier.tier.layout) + keys[1]) == 1

        ctx = h.new_request()
        assert h.lookup_until_settled(keys[0], ctx) is LookupResult.HIT
        assert h.load([keys[0]], ctx) == [payloads[keys[0]].tobytes()]
        assert h.lookup_until_settled(keys[1], ctx) is LookupResult.MISS
        assert h.tier.tier.stats()["failed_load_missing"] == 1
    finally:
        h.close()
