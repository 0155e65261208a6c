"""Byte-exact store/load round trips through the connector worker, for every layout and handler.

Each test: random KV -> store engine blocks to host slots -> poison the engine -> load the slots
into other engine blocks -> every loaded page equals the stored one, byte for byte; the store's
source is unchanged; engine blocks and host slots outside the map keep their poison.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_cases import HANDLERS, HOST_POISON, LAYOUTS, Cache, finish, make_cache, make_worker

from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import ConnectorMetadata, TransferJob, TransferResult
from kvoffload.worker import CopyPlanner, KVCacheLayout
from kvoffload.worker.mapping import BlockMapping

ENGINE_POISON = -7.0


def store(worker, job_id: int, blocks: list[list[int]], slots: list[list[int]]) -> TransferResult:
    """Store ``blocks[g]`` (whole offloaded blocks) into ``slots[g]``, one engine step."""
    src = GPULoadStoreSpec(
        [b for g in blocks for b in g], [len(g) for g in blocks], [0] * len(blocks)
    )
    job = TransferJob(job_id, "req", src, CPULoadStoreSpec([s for g in slots for s in g]))
    worker.start_load_kv(ConnectorMetadata(store_jobs=[job]))
    worker.wait_for_save()
    return finish(worker, [job_id])[job_id]


def load(
    worker, job_id: int, slots: list[list[int]], blocks: list[list[int]], block_indices: list[int]
) -> TransferResult:
    dst = GPULoadStoreSpec([b for g in blocks for b in g], [len(g) for g in blocks], block_indices)
    job = TransferJob(job_id, "req", CPULoadStoreSpec([s for g in slots for s in g]), dst)
    worker.start_load_kv(ConnectorMetadata(load_jobs=[job]))
    worker.wait_for_save()
    return finish(worker, [job_id])[job_id]


def pages_of(cache: Cache, blocks: list[list[int]]) -> list[list[list[torch.Tensor]]]:
    """pages[g][i] = group g's pages of engine block blocks[g][i]."""
    return [[cache.group_pages(g, b) for b in group] for g, group in enumerate(blocks)]


def round_trip(
    cache: Cache,
    worker,
    factor: int | list[int],
    rng: random.Random,
    num_slots: int,
    skip: list[int],
    tail: list[int],
):
    """Store random whole blocks per group, then load them back from ``skip[g]`` pages in, leaving
    ``tail[g]`` pages out, into other engine blocks; check everything."""
    groups = len(cache.group_tensors)
    factors = [factor] * groups if isinstance(factor, int) else factor
    n = cache.num_blocks
    slots_per_group = [rng.randint(1, max(1, num_slots // groups)) for _ in range(groups)]
    all_slots = rng.sample(range(num_slots), sum(slots_per_group))
    slots = [
        all_slots[sum(slots_per_group[:g]) : sum(slots_per_group[: g + 1])] for g in range(groups)
    ]
    src_blocks = [
        rng.sample(range(n), k * f) for k, f in zip(slots_per_group, factors, strict=True)
    ]

    cache.randomize(rng.randrange(2**31))
    worker.host_pool.buffer.fill_(HOST_POISON)
    before = cache.snapshot()
    stored = pages_of(cache, src_blocks)
    assert store(worker, 1, src_blocks, slots).success
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors, strict=True)), (
        "a store modified its source"
    )
    host = worker.host_pool.slots.cpu()
    used = set(all_slots)
    assert all(torch.all(host[s] == HOST_POISON) for s in range(num_slots) if s not in used)
    for g, group_slots in enumerate(slots):  # a smaller group leaves the slot tail alone
        tail_from = worker.layout.groups[g].bytes_per_offloaded_block
        assert all(torch.all(host[s, tail_from:] == HOST_POISON) for s in group_slots)

    cache.poison_blocks(list(range(n)), ENGINE_POISON)
    poisoned = cache.page(0, 0).clone()
    counts = [k * factors[g] - skip[g] - tail[g] for g, k in enumerate(slots_per_group)]
    dst_all = rng.sample(range(n), sum(counts))
    dst_blocks = [dst_all[sum(counts[:g]) : sum(counts[: g + 1])] for g in range(groups)]
    indices = [
        3 * factors[g] + skip[g] for g in range(groups)
    ]  # any request position with that offset
    load_slots = [s if counts[g] else [] for g, s in enumerate(slots)]
    assert load(worker, 2, load_slots, dst_blocks, indices).success
    for g in range(groups):
        for i, block in enumerate(dst_blocks[g]):
            expected = stored[g][skip[g] + i]
            assert all(
                torch.equal(a, b)
                for a, b in zip(cache.group_pages(g, block), expected, strict=True)
            ), (g, i)
    untouched = set(range(n)) - set(dst_all)
    for t in range(len(cache.tensors)):
        assert all(
            torch.equal(cache.page(t, b), poisoned[: cache.page(t, b).numel()]) for b in untouched
        )
    assert torch.equal(worker.host_pool.slots.cpu(), host), "a load modified the host pool"


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("device", "torch_copies"), HANDLERS)
def test_round_trip_whole_blocks(device, torch_copies, layout, factor):
    cache = make_cache(layout, device, num_blocks=48)
    with make_worker(cache, factor, num_slots=10, use_torch_copies=torch_copies) as worker:
        groups = len(cache.group_tensors)
        round_trip(
            cache,
            worker,
            factor,
            random.Random(f"{layout}{factor}"),
            10,
            [0] * groups,
            [0] * groups,
        )


@pytest.mark.parametrize(("skip", "tail"), [(1, 0), (3, 0), (2, 1), (0, 3)])
@pytest.mark.parametrize("layout", ["per_layer", "cross_layer", "two_groups"])
@pytest.mark.parametrize(("device", "torch_copies"), HANDLERS)
def test_load_starting_mid_block(device, torch_copies, layout, skip, tail):
    """The first offloaded block is partly on the engine already: only its remaining pages load."""
    cache = make_cache(layout, device, num_blocks=48)
    with make_worker(cache, 4, num_slots=10, use_torch_copies=torch_copies) as worker:
        groups = len(cache.group_tensors)
        round_trip(
            cache, worker, 4, random.Random(skip * 10 + tail), 10, [skip] * groups, [tail] * groups
        )


@pytest.mark.parametrize(("device", "torch_copies"), HANDLERS)
def test_group_with_no_blocks_in_a_job(device, torch_copies):
    cache = make_cache("two_groups", device, num_blocks=16)
    cache.randomize(3)
    with make_worker(cache, 2, num_slots=4, use_torch_copies=torch_copies) as worker:
        expected = cache.group_pages(1, 5) + cache.group_pages(1, 9)
        assert store(worker, 1, [[], [5, 9]], [[], [2]]).success
        cache.poison_blocks(list(range(16)))
        assert load(worker, 2, [[], [2]], [[], [0, 1]], [0, 0]).success
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                cache.group_pages(1, 0) + cache.group_pages(1, 1), expected, strict=True
            )
        )


@pytest.mark.parametrize(("device", "torch_copies"), HANDLERS)
def test_groups_with_different_factors(device, torch_copies):
    """Group 0 offloads 2 engine blocks per slot, group 1 four, sharing one pool of slots."""
    cache = make_cache("two_groups", device, num_blocks=48)
    with make_worker(cache, [2, 4], num_slots=10, use_torch_copies=torch_copies) as worker:
        assert [g.block_size_factor for g in worker.layout.groups] == [2, 4]
        round_trip(cache, worker, [2, 4], random.Random(5), 10, [1, 3], [0, 0])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUTS),
    factor_choices=st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=2),
    torch_copies=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_random_block_maps_round_trip(layout, factor_choices, torch_copies, seed, data):
    cache = make_cache(layout, "cpu", num_blocks=40, layers=2)
    groups = len(cache.group_tensors)
    factors = factor_choices[:groups]
    skip = [data.draw(st.integers(0, f - 1)) for f in factors]
    tail = [data.draw(st.integers(0, f - 1 - s)) for f, s in zip(factors, skip, strict=True)]
    with make_worker(cache, factors, num_slots=8, use_torch_copies=torch_copies) as worker:
        round_trip(cache, worker, factors, random.Random(seed), 8, skip, tail)


def test_threads_and_torch_reference_write_identical_host_bytes():
    """Twin run: the threaded handler and the torch reference produce the same host pool."""
    pools = []
    for torch_copies in (False, True):
        cache = make_cache("kv_split", num_blocks=32)
        cache.randomize(11)
        with make_worker(cache, 4, num_slots=6, use_torch_copies=torch_copies) as worker:
            worker.host_pool.buffer.fill_(HOST_POISON)
            assert store(worker, 1, [[7, 3, 30, 1, 2, 3 + 10, 14, 15]], [[5, 0]]).success
            pools.append(worker.host_pool.buffer.clone())
    assert torch.equal(*pools)


def test_adjacent_pages_coalesce_into_one_copy():
    """Consecutive engine blocks into consecutive slots of a one-view group: a single memmove."""
    cache = make_cache("cross_layer", num_blocks=32)
    kv = KVCacheLayout.from_kv_caches(cache.tensors, 4)
    spec = GPULoadStoreSpec(list(range(8, 20)), [12], [0])
    mapping = BlockMapping.from_specs(
        spec,
        CPULoadStoreSpec([3, 4, 5]),
        is_store=True,
        block_size_factors=[4],
        num_engine_blocks=32,
        num_host_slots=8,
    )
    dst, src, nbytes = CopyPlanner(kv, 1 << 40, 8 * kv.slot_bytes).plan(mapping, is_store=True)
    assert nbytes.tolist() == [12 * kv.groups[0].views[0].page_bytes]
    assert dst.tolist() == [(1 << 40) + 3 * kv.slot_bytes]
    assert src.tolist() == [kv.groups[0].views[0].address + 8 * kv.groups[0].views[0].block_stride]
    # per-layer views: one run per view per slot
    per_layer = KVCacheLayout.from_kv_caches(make_cache("per_layer", num_blocks=32).tensors, 4)
    _, _, nbytes = CopyPlanner(per_layer, 1 << 40, 8 * per_layer.slot_bytes).plan(
        mapping, is_store=True
    )
    assert len(nbytes) == 3 * 3 and np.all(nbytes == 4 * 256)
