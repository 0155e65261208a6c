"""``KVOffloadSpec``: our scheduler-side stack loaded by vLLM 0.33 as an out-of-tree spec.

Loaded exactly as vLLM's connector loads it (``OffloadingSpecFactory.create_spec`` on an
``OffloadingConfig`` whose ``kv_connector_extra_config`` has ``spec_name`` +
``spec_module_path``) and driven through vLLM's ``OffloadingManager`` interface. The GPU worker's
copies are stood in for by a second mapping of vLLM's shared CPU pool (the same file the worker
maps, same engine id), written and read at the chunk ids the manager returns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_cases import offloading_config, require_vllm, unique_engine_id, vllm_keys

require_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvoffload.errors import ConfigError  # noqa: E402
from kvoffload.integrations.vllm.manager import STATS_METRIC, KVOffloadManager  # noqa: E402
from kvoffload.integrations.vllm.region import region_path  # noqa: E402
from kvoffload.integrations.vllm.replay import serve_request  # noqa: E402
from kvoffload.integrations.vllm.spec import KVOffloadSpec  # noqa: E402
from kvoffload.managers import FilterReusedOffloadingManager  # noqa: E402
from kvoffload.managers.tiering import TieringOffloadingManager  # noqa: E402

CHUNK = 4096
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm.spec"}


def worker_region(spec: Any) -> SharedOffloadRegion:
    """A worker's mapping of ``spec``'s pool (rank 0)."""
    return SharedOffloadRegion(
        engine_id=spec.config.engine_id,
        num_chunks=spec.num_chunks,
        rank=0,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )


class SpecHarness:
    def __init__(self, extra: dict[str, Any], num_chunks: int = 8) -> None:
        engine_id = unique_engine_id()
        config = offloading_config(
            {**SPEC, **extra}, num_chunks=num_chunks, chunk_bytes=CHUNK, engine_id=engine_id
        )
        self.spec = OffloadingSpecFactory.create_spec(config)
        assert isinstance(self.spec, KVOffloadSpec)
        # The worker's mapping of the same pool (what vLLM's CPUOffloadingWorker copies into),
        # made first, as vLLM does (workers register their KV caches before the scheduler).
        self._worker_region = worker_region(self.spec)
        self._view = self._worker_region.create_kv_memoryview()
        self.pool = np.asarray(self._view)
        manager = self.spec.get_manager()
        assert isinstance(manager, KVOffloadManager)
        self.manager = manager
        self._n = 0

    def request(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"req-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def settle(self) -> None:
        """End the step after our tiers' I/O finished (deterministic)."""
        inner = self.manager.inner
        tiering = inner.backing if isinstance(inner, FilterReusedOffloadingManager) else inner
        if isinstance(tiering, TieringOffloadingManager):
            tiering.step_end()
            for tier in tiering.tiers:
                tier.drain_jobs()
        self.manager.on_schedule_end(STEP_END)

    def close(self) -> None:
        del self.pool
        self._view.release()
        self._worker_region.cleanup()
        self.manager.shutdown()


@pytest.fixture
def make_harness() -> Iterator[Any]:
    made: list[SpecHarness] = []

    def make(extra: dict[str, Any], num_chunks: int = 8) -> SpecHarness:
        h = SpecHarness(extra, num_chunks)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_spec_serves_requests_with_our_policy(make_harness: Any) -> None:
    h = make_harness({"eviction_policy": "prefix"})
    assert h.manager.inner.policy.name == "prefix"
    keys = vllm_keys(4)
    assert serve_request(h.manager, keys, "a") == 0
    assert serve_request(h.manager, keys, "b") == 4  # stored by the first, loaded by the second
    events = list(h.manager.take_events())
    assert events and all(e.medium is Medium.CPU for e in events)
    stats = h.manager.get_stats().reduce()
    assert any(STATS_METRIC in name for name in stats), stats


def test_reuse_filter_counts_requests_not_lookups(make_harness: Any) -> None:
    h = make_harness({"store_threshold": 2})
    assert isinstance(h.manager.inner, FilterReusedOffloadingManager)
    keys = vllm_keys(3, start=10)
    ctx = h.request()
    for _ in range(5):  # one request looking a block up on five steps: one request
        assert h.manager.lookup(keys[0], ctx) is LookupResult.MISS
    out = h.manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == []  # seen by one request only
    h.manager.on_request_finished(ctx)
    assert serve_request(h.manager, keys, "second") == 0  # the second request stores them
    assert serve_request(h.manager, keys, "third") == 3


def test_engine_step_s_times_every_step_a_request_is_in_the_engine(make_harness: Any) -> None:
    """Decode steps (no lookup, no store) are engine steps too; steps with no request in the
    engine (idle, where vLLM does not step) are not. The old count only took consecutive steps
    that offered blocks to store: 0 here."""
    h = make_harness({})
    h.manager.on_schedule_end(STEP_END)  # idle
    ctx = h.request()
    for _ in range(4):  # four steps with the request in the engine, none storing
        h.manager.on_schedule_end(STEP_END)
    h.manager.on_request_finished(ctx)
    h.manager.on_schedule_end(STEP_END)  # the request left during this one
    h.manager.on_schedule_end(STEP_END)  # idle again
    steps = h.manager.waits.summary()["engine_step_s"]
    assert steps["count"] == 3  # between the four busy ends


def test_stats_carry_only_the_gauges_that_changed(make_harness: Any) -> None:
    """vLLM asks every step and ships what it gets to its API server: the first call carries
    every gauge, a call with nothing changed none (vLLM then ships nothing), a store only the
    gauges it moved. The old code sent every gauge (~90 with tiers) on every step."""
    h = make_harness({})
    first = h.manager.get_stats().reduce()
    assert f"{STATS_METRIC}:('capacity_blocks',)" in first
    assert f"{STATS_METRIC}:('engine_step_s_p50',)" in first
    assert h.manager.get_stats().is_empty()
    assert serve_request(h.manager, vllm_keys(2, start=40), "a") == 0
    moved = h.manager.get_stats().reduce()
    assert moved[f"{STATS_METRIC}:('stored_blocks',)"] == 2
    assert f"{STATS_METRIC}:('capacity_blocks',)" not in moved


def test_tiers_cascade_and_promote_through_the_spec(make_harness: Any, tmp_path: Path) -> None:
    h = make_harness(
        {
            "kvoffload_tiers": [
                {"kind": "disk", "path": str(tmp_path), "size_gib": 0.01, "rescan_interval": 0}
            ]
        },
        num_chunks=4,
    )
    keys = vllm_keys(4, start=20)
    rng = np.random.default_rng(0)
    payloads = {k: rng.integers(-128, 128, CHUNK, dtype=np.int8) for k in keys}
    ctx = h.request()
    out = h.manager.prepare_store(keys, ctx)
    assert out is not None
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        h.pool[chunk] = payloads[key]  # the worker's GPU->CPU copy
    h.manager.complete_store(out.keys_to_store, ctx)
    h.manager.on_request_finished(ctx)
    h.settle()
    h.settle()  # the cascade to disk is done and applied

    others = vllm_keys(4, start=40)  # a full CPU pool of other blocks evicts ours
    assert serve_request(h.manager, others, "others") == 0
    h.settle()
    h.settle()

    reader = h.request()
    deadline = time.monotonic() + 60
    while (result := h.manager.lookup(keys[0], reader)) is LookupResult.RETRY:
        assert time.monotonic() < deadline
        h.settle()  # our tiering manager promotes from disk meanwhile (RETRY = ask next step)
    assert result is LookupResult.HIT
    spec = h.manager.prepare_load([keys[0]], reader)
    # vLLM asks each loaded key's source after prepare_load: a promoted block counts as disk
    # (vLLM's hit counters by source), a block the host held all along as host.
    assert h.manager.get_load_source(keys[0], reader) is CacheHitSource.DISK
    assert h.manager.get_load_source(others[-1], reader) is CacheHitSource.HOST
    (chunk,) = spec.chunk_ids
    assert h.pool[chunk].tobytes() == payloads[keys[0]].tobytes()
    h.manager.complete_load([keys[0]], reader)
    storage = [e for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    assert storage, "our disk tier announced its blocks"


@pytest.mark.parametrize(
    ("extra", "setting"),
    [
        ({"eviction_policy": "nope"}, "eviction_policy"),
        ({"store_threshold": -1}, "store_threshold"),
        ({"kvoffload_cascade": "sometimes"}, "kvoffload_cascade"),
        ({"kvoffload_tiers": [{"kind": "tape"}]}, "kvoffload_tiers.kind"),
        ({"kvoffload_tiers": [{"kind": "disk", "path": "kv"}]}, "kvoffload_tiers.size_gib"),
        ({"secondary_tiers": [{"type": "example"}]}, "secondary_tiers"),
    ],
)
def test_bad_settings_are_config_errors(extra: dict[str, Any], setting: str) -> None:
    config = offloading_config({**SPEC, **extra}, num_chunks=4)
    with pytest.raises(ConfigError) as info:
        OffloadingSpecFactory.create_spec(config).get_manager()  # no pool file is left behind
    assert info.value.field == setting


def test_tier_blocks_are_named_by_the_models_content_not_its_path(tmp_path: Path) -> None:
    """Two copies of one checkpoint share blocks; other weights under a path once used do not
    (``layout_of_spec`` named the model by its path before)."""
    import shutil

    from kvoffload.integrations.vllm.tiers import layout_of_spec
    from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

    first = write_tiny_llama(tmp_path / "a", seed=0)
    copy = Path(shutil.copytree(first, tmp_path / "b"))
    other = write_tiny_llama(tmp_path / "c", seed=1)

    def model_of(directory: Path) -> str:
        config = offloading_config(SPEC, num_chunks=4, model_name=str(directory))
        return layout_of_spec(OffloadingSpecFactory.create_spec(config), CHUNK).model

    assert model_of(first) == model_of(copy)
    assert model_of(first) != model_of(other)
    shutil.rmtree(first)
    shutil.copytree(other, first)  # new weights under the old path
    assert model_of(first) == model_of(other)


def _undigestible_checkpoint(directory: Path) -> Path:
    """A checkpoint whose weight file cannot be read: naming the model by content fails."""
    directory.mkdir()
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (directory / "model.safetensors").symlink_to(directory / "gone")
    return directory


def test_no_tier_no_weight_digest(tmp_path: Path) -> None:
    """Without a secondary tier nothing leaves this process: the weights are not digested (a
    checkpoint that cannot be digested starts); with a disk tier the digest fails loudly."""
    model = str(_undigestible_checkpoint(tmp_path / "ckpt"))
    config = offloading_config(SPEC, num_chunks=4, model_name=model)
    spec = OffloadingSpecFactory.create_spec(config)
    spec.get_manager().shutdown()
    tiers = [{"kind": "disk", "path": str(tmp_path / "kv"), "size_gib": 0.01}]
    config = offloading_config({**SPEC, "kvoffload_tiers": tiers}, num_chunks=4, model_name=model)
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadingSpecFactory.create_spec(config).get_manager()


@pytest.mark.parametrize(
    ("key", "close"),
    [("kvoffload_tier", "kvoffload_tiers"), ("kvoffload_lookup_retry", "kvoffload_lookup_retry_s")],
)
def test_misspelt_kvoffload_setting_is_an_error_naming_it(key: str, close: str) -> None:
    config = offloading_config({**SPEC, key: []}, num_chunks=4)
    with pytest.raises(ConfigError) as info:
        OffloadingSpecFactory.create_spec(config)
    assert info.value.field == key
    assert close in str(info.value)


def test_pool_file_leaves_dev_shm_once_the_scheduler_mapped_it(make_harness: Any) -> None:
    """The workers map the pool first; the scheduler side's mapping is the last one needed, so
    the name goes then (a SIGINT'd vLLM leaves nothing in /dev/shm) and the mappings stay one
    pool: a block the worker writes is what the manager's tiers read."""
    h = make_harness({})
    path = region_path(h.spec.config.engine_id)
    assert not os.path.exists(path)
    keys = vllm_keys(1, start=90)
    assert serve_request(h.manager, keys, "a") == 0
    assert serve_request(h.manager, keys, "b") == 1


def test_failed_start_leaves_no_pool_file(tmp_path: Path) -> None:
    """The workers mapped the pool, then the scheduler side fails on a tier setting: the name is
    gone already (no cleanup of the workers is needed for it)."""
    model = str(_undigestible_checkpoint(tmp_path / "ckpt"))
    tiers = [{"kind": "disk", "path": str(tmp_path / "kv"), "size_gib": 0.01}]
    config = offloading_config({**SPEC, "kvoffload_tiers": tiers}, num_chunks=4, model_name=model)
    spec = OffloadingSpecFactory.create_spec(config)
    worker = worker_region(spec)
    path = region_path(config.engine_id)
    assert os.path.exists(path)
    try:
        with pytest.raises(ConfigError, match="cannot read"):
            spec.get_manager()
        assert not os.path.exists(path)
    finally:
        worker.cleanup()


def test_scheduler_first_keeps_the_name_for_the_workers_until_shutdown() -> None:
    """Scheduler-only use (no worker mapped the pool yet): the name stays for workers to come,
    and shutdown removes it."""
    config = offloading_config(SPEC, num_chunks=4)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    path = region_path(config.engine_id)
    assert os.path.exists(path)
    manager.shutdown()
    assert not os.path.exists(path)
