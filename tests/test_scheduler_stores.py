"""Scheduler side, stores: granularity, keys, re-offers after ``None``, store policies and the
per-request ``kv_transfer_params`` that choose them.

Every test runs the real connector and CPU manager inside :class:`fake_engine.FakeEngine`, which
checks the KV oracle, the tier's contents and block accounting after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import (
    FINISHED,
    WAITING,
    FakeEngine,
    FakeRequest,
    RecordingManager,
    make_tokens,
    single_group,
)

from kvoffload import (
    BlockHasher,
    ConfigError,
    ContractError,
    CPUOffloadingManager,
    OffloadKey,
    make_offload_key,
)
from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.scheduler import OffloadingConnectorScheduler, parse_kv_transfer_params


def keys_of(req: FakeRequest, engine_block_size: int, factor: int, n: int) -> list[OffloadKey]:
    """The keys of ``req``'s first ``n`` offloaded blocks, hashed independently of the harness:
    the hash of the last engine block inside each offloaded block, group 0."""
    hashes = BlockHasher(engine_block_size, "xxh3_128").hash_blocks(req.all_token_ids)
    return [make_offload_key(hashes[(i + 1) * factor - 1], 0) for i in range(n)]


def stored_by(manager: RecordingManager, req_id: str) -> list[OffloadKey]:
    """Keys the manager prepared for storing on behalf of ``req_id``, in order."""
    return [
        k
        for c in manager.of("prepare_store", req_id)
        if c.result is not None
        for k in c.result.keys_to_store
    ]


@pytest.mark.parametrize("factor", [1, 3])
def test_store_granularity_is_the_offloaded_block(factor: int) -> None:
    """Exactly the full offloaded blocks are stored, each in the step that computes its last
    token, from the engine blocks that hold it; partial blocks never; key = last engine block's
    hash + group."""
    ebs = 4
    obs = ebs * factor
    engine = FakeEngine(single_group(ebs, factor), num_engine_blocks=32, token_budget=5)
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    req = engine.add_request(make_tokens(50, 1), max_tokens=6)
    while not engine.is_idle():
        before = req.num_computed_tokens
        n_calls = len(manager.calls)
        record = engine.step()
        after = req.num_computed_tokens
        blocks = list(range(before // obs, after // obs))  # completed by this step
        offered = [c for c in manager.calls[n_calls:] if c.method == "prepare_store"]
        if not blocks:
            assert not offered and not record.meta.store_jobs, (
                f"step {record.step}: stored a partial block"
            )
            continue
        assert req.status != FINISHED  # (its table is gone then; no block completes in that step)
        expected = keys_of(req, ebs, factor, after // obs)[blocks[0] :]
        assert [list(c.keys) for c in offered] == [expected]
        assert offered[0].result.keys_to_store == expected
        (job,) = record.meta.store_jobs
        assert isinstance(job.src, GPULoadStoreSpec) and isinstance(job.dst, CPULoadStoreSpec)
        assert (
            job.src.block_ids == req.block_table[0][blocks[0] * factor : (blocks[-1] + 1) * factor]
        )
        assert job.src.group_sizes == [len(blocks) * factor]
        assert job.src.block_indices == [blocks[0] * factor]
        assert job.dst.block_ids == offered[0].result.store_spec.block_ids
    # 50 prompt + 5 computed generated tokens: the partial tail block is never stored.
    assert req.num_computed_tokens == 55
    assert engine.stored_keys() == set(keys_of(req, ebs, factor, 55 // obs))
    engine.check_drained()


@pytest.mark.parametrize("blocker", ["pending", "pinned"])
def test_rejected_store_is_offered_again(blocker: str) -> None:
    """When prepare_store answers None (tier full of pending or pinned blocks), the blocks are
    offered again on later steps and stored once room appears: not dropped."""
    manual = "x" if blocker == "pending" else "z"  # the request whose transfers wait for the test
    engine = FakeEngine(
        single_group(4), num_host_blocks=4, delay=lambda job, w: None if job.req_id == manual else 0
    )
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    x_prompt = make_tokens(17, 1)
    engine.add_request(x_prompt, max_tokens=1, req_id="x")
    if blocker == "pending":
        engine.step()  # x's 4 blocks: prepared, never completed
    else:
        engine.run()
        engine.drop_prefix_cache()
        engine.add_request([*x_prompt, 5], max_tokens=1, req_id="z")
        engine.step()  # z loads x's 4 blocks: pinned until the test completes the load
        assert engine.lookup_of("z")[0].external == 16
    assert engine.manager.stats()["used_blocks"] == 4

    y = engine.add_request(make_tokens(9, 2), max_tokens=12, req_id="y")
    for _ in range(3):
        engine.step()
    offers = [c for c in manager.of("prepare_store", "y") if len(c.keys) == 2]
    assert len(offers) == 3, "y's two blocks are offered every step while the tier is full"
    assert all(c.result is None for c in manager.of("prepare_store", "y"))
    assert not stored_by(manager, "y")
    assert engine.connector.stats()["rejected_stores"] == 3

    engine.executor.complete()  # x's store (or z's load) finishes: its blocks become evictable
    engine.run_until(lambda: bool(stored_by(manager, "y")))
    assert stored_by(manager, "y")[:2] == keys_of(y, 4, 1, 2)
    assert set(keys_of(y, 4, 1, 2)) <= engine.ready_keys()
    engine.run()
    engine.check_drained()


def test_on_finish_stores_everything_at_finish_and_keeps_blocks() -> None:
    """``on_finish``: nothing while running; at finish every full block (prompt and generated) is
    stored, and the engine keeps the request's blocks until the stores complete."""
    engine = FakeEngine(
        single_group(4, store_policy="on_finish"), num_engine_blocks=16, store_delay=2
    )
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    a = engine.add_request(make_tokens(21, 1), max_tokens=8, req_id="a")
    engine.run_until(lambda: a.status == FINISHED)
    # The only prepare_store came from request_finished, right before it told the manager.
    assert [c.method for c in manager.calls[-2:]] == ["prepare_store", "request_finished"]
    assert len(manager.of("prepare_store")) == 1 and not engine.executor.jobs(stores=True)
    assert "a" in engine.delayed_free, "the finish-time stores still need a's blocks"

    # b needs 10 blocks at once; only 16 - 7 are free while a's blocks are kept.
    b = engine.add_request(make_tokens(40, 2), max_tokens=1, req_id="b")
    record = engine.step()
    (job,) = record.meta.store_jobs
    assert job.req_id == "a"
    # 21 prompt + 7 computed generated tokens: 7 full blocks, the last two with generated tokens.
    assert stored_by(manager, "a") == keys_of(a, 4, 1, 7)
    assert b.status == WAITING
    engine.run_until(lambda: "a" not in engine.delayed_free)
    assert {k for k in keys_of(a, 4, 1, 7)} <= engine.ready_keys()
    engine.run()
    assert b.status == FINISHED
    engine.check_drained()


def test_prompt_only_never_stores_generated_blocks() -> None:
    engine = FakeEngine(single_group(4, store_policy="prompt_only"), token_budget=8)
    req = engine.add_request(make_tokens(22, 1), max_tokens=10)
    engine.run()
    # Blocks 0-4 hold prompt tokens only; block 5 (tokens 20-23) holds two generated ones.
    assert engine.stored_keys() == set(keys_of(req, 4, 1, 5))
    engine.check_drained()


@pytest.mark.parametrize("policy", ["on_finish", "prompt_only"])
def test_store_policy_chosen_per_request(policy: str) -> None:
    """``kv_transfer_params={"store_policy": ...}`` overrides the configured default for one
    request; its neighbour keeps ``on_compute``."""
    engine = FakeEngine(single_group(4), token_budget=64)
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    special = engine.add_request(
        make_tokens(22, 1), max_tokens=10, kv_transfer_params={"store_policy": policy}
    )
    plain = engine.add_request(make_tokens(22, 2), max_tokens=10)
    engine.step()
    assert stored_by(manager, plain.request_id) == keys_of(plain, 4, 1, 5)  # stored as computed
    if policy == "on_finish":
        assert not stored_by(manager, special.request_id)
    else:
        assert stored_by(manager, special.request_id) == keys_of(special, 4, 1, 5)
    engine.run()
    n_special = 7 if policy == "on_finish" else 5  # 31 computed tokens; prompt_only: 22 -> 5 blocks
    assert stored_by(manager, special.request_id) == keys_of(special, 4, 1, n_special)
    assert stored_by(manager, plain.request_id) == keys_of(plain, 4, 1, 7)
    engine.check_drained()


@pytest.mark.parametrize(("cap", "n_blocks"), [(10, 2), (0, 0), (100, 7)])
def test_max_offload_tokens(cap: int, n_blocks: int) -> None:
    """Only blocks within the first ``max_offload_tokens`` tokens are stored."""
    engine = FakeEngine(single_group(4))
    req = engine.add_request(
        make_tokens(30, 1), max_tokens=1, kv_transfer_params={"max_offload_tokens": cap}
    )
    engine.run()
    assert engine.stored_keys() == set(keys_of(req, 4, 1, n_blocks))
    engine.check_drained()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"store_policy": "on_sunday"}, "kv_transfer_params.store_policy"),
        ({"store_policy": ["on_finish"]}, "kv_transfer_params.store_policy"),
        ({"store_policy": None}, "kv_transfer_params.store_policy"),
        ({"max_offload_tokens": -1}, "kv_transfer_params.max_offload_tokens"),
        ({"max_offload_tokens": "5"}, "kv_transfer_params.max_offload_tokens"),
        ({"max_offload_tokens": True}, "kv_transfer_params.max_offload_tokens"),
        ({"max_load_tokens": 1.5}, "kv_transfer_params.max_load_tokens"),
    ],
)
def test_bad_kv_transfer_params_name_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_kv_transfer_params(params, "on_compute")
    assert exc.value.field == field
    assert field in str(exc.value)

    engine = FakeEngine(single_group(4))
    req = engine.add_request(make_tokens(9, 1), kv_transfer_params=params)
    with pytest.raises(ConfigError) as exc:
        engine.connector.get_num_new_matched_tokens(req, 0)
    assert exc.value.field == field
    assert engine.connector.stats()["live_requests"] == 0, "a rejected request leaves no state"


def test_bad_configured_store_policy_names_the_field() -> None:
    with pytest.raises(ConfigError) as exc:
        OffloadingConnectorScheduler(
            single_group(4, store_policy="sometimes"), CPUOffloadingManager(4)
        )
    assert exc.value.field == "store_policy"


def test_unknown_kv_transfer_params_keys_are_left_alone() -> None:
    assert parse_kv_transfer_params(
        {"do_remote_decode": True, "max_load_tokens": 8}, "on_finish"
    ) == (
        "on_finish",
        None,
        8,
    )


class ReorderingManager(RecordingManager):
    """A tier that answers ``prepare_store`` with its keys in reverse order (the spec stays
    co-indexed with them): the contract only ties ``store_spec`` to ``keys_to_store``."""

    def prepare_store(self, keys, ctx):
        out = super().prepare_store(keys, ctx)
        if out is not None and len(out.keys_to_store) > 1:
            assert isinstance(out.store_spec, CPULoadStoreSpec)
            out.keys_to_store.reverse()
            out.store_spec.block_ids.reverse()
        return out


def test_a_tier_answering_in_another_order_still_gets_the_right_blocks() -> None:
    """Each stored block's engine pages go to the slot of *its* key (the harness checks every
    readable tier block against its key's data), and loads of them serve the right KV."""
    engine = FakeEngine(
        single_group(4, 2),
        num_engine_blocks=24,
        manager=ReorderingManager(64),
        enable_prefix_caching=False,
    )
    for i in range(3):
        engine.add_request(make_tokens(40, 7), max_tokens=2, req_id=f"r{i}")
        engine.run()
    engine.add_request(make_tokens(30, 8), max_tokens=2, req_id="other")
    engine.run()
    engine.add_request(make_tokens(40, 7), max_tokens=2, req_id="again")
    engine.run()
    assert engine.connector.stats()["loaded_blocks"] > 0
    engine.check_drained()


def test_a_request_id_still_in_use_is_refused() -> None:
    """A finished request whose stores are in flight keeps its id: reusing it would mix the two
    requests' blocks (the old stores' completion would free the new request's blocks)."""
    engine = FakeEngine(
        single_group(4, store_policy="on_finish"), num_engine_blocks=16, store_delay=3
    )
    a = engine.add_request(make_tokens(21, 1), max_tokens=4, req_id="a")
    engine.run_until(lambda: a.status == FINISHED)
    assert "a" in engine.delayed_free
    twin = FakeRequest("a", make_tokens(21, 2), 4, None, engine.hasher, 1, 0)
    with pytest.raises(ContractError, match="still in use"):
        engine.connector.get_num_new_matched_tokens(twin, 0)
    engine.run()
    engine.check_drained()
