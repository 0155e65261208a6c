"""Operator controls on a real engine (the tiny model, real host pool, disk files, Redis): a pinned
system prompt keeps its hits under pressure that evicts everything else, with no removal event
and exact outputs; unpinning lets it go; warming makes the first request a full hit; clears are
announced and counted, by tier and by model; lookups equal what an event-fed index holds; disk
pins survive a restart."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_cases import (
    EventCollector,
    assert_quiescent,
    assert_same_outputs,
    greedy,
    host_gib,
    one_thread,  # noqa: F401  (autouse)
    random_tokens,
    reference_outputs,
    tiny_engine,
)

from kvoffload.engine import Engine
from kvoffload.errors import ConfigError
from kvoffload.events.block_index import BlockIndex
from kvoffload.events.messages import BlockRemoved, external_block_hash
from kvoffload.keys import offload_key_hash
from kvoffload.managers.pins import PinQuotaExceeded

EVENTS = {"enable_kv_cache_events": True, "publisher": "null"}
SAMPLING = greedy(max_tokens=3)
SYSTEM = random_tokens(random.Random(7), 24)  # 6 blocks of 4 tokens
FILE, LEDGER = 8192, 4096  # the tiny preset's block file and the disk ledger


def _disk_gib(blocks: int) -> float:
    return (LEDGER + blocks * FILE) / 2**30


def _engine(**kwargs: Any) -> Engine:
    options: dict[str, Any] = {
        "num_device_blocks": 40,
        "kv_offloading_size": host_gib(16),
        "eviction_policy": "lru",
        "kv_events_config": EVENTS,
        "kv_lookup_retry_s": 600.0,
        # Every offer stored: the pressure these tests build must not be shed away.
        "kv_store_max_in_flight": 1000,
    }
    options.update(kwargs)
    engine = tiny_engine(**options)
    engine.publisher = EventCollector()
    return engine


def _workload(seed: int = 0, rounds: int = 8) -> list[list[list[int]]]:
    """Rounds of one request on the system prompt, then two of 8 fresh blocks each: each round
    stores 18 new blocks in a host tier of 16."""
    rng = random.Random(seed)
    return [[SYSTEM + random_tokens(rng, 8), random_tokens(rng, 32), random_tokens(rng, 32)]
            for _ in range(rounds)]


def _removed_from(engine: Engine, tier_medium: str) -> set[Any]:
    collector: Any = engine.publisher
    return {h for batch in collector.batches for e in batch.events
            if isinstance(e, BlockRemoved) and e.medium == tier_medium for h in e.block_hashes}


def _system_hashes(engine: Engine) -> set[Any]:
    keys = engine.admin.prompt(SYSTEM).keys
    return {external_block_hash(offload_key_hash(k), engine.config.events.int_block_hashes)
            for k in keys}


def _run(engine: Engine, rounds: list[list[list[int]]]) -> tuple[list[Any], list[int]]:
    """Each round after a device clear (so hits must come from the host tier); the outputs and
    the host hits of each request on the system prompt."""
    outputs, system_hits = [], []
    for prompts in rounds:
        engine.admin.clear(["device"])
        outs = engine.generate(prompts, SAMPLING)
        engine.drain()
        system_hits.append(outs[0].cached_tokens_offload)
        outputs += outs
    return outputs, system_hits


@pytest.mark.parametrize("policy", ["lru", "adaptive", "s3fifo"])
def test_a_pinned_system_prompt_keeps_its_hits_under_pressure(policy: str) -> None:
    rounds = _workload()
    want = reference_outputs([p for r in rounds for p in r], SAMPLING)
    with _engine(eviction_policy=policy) as engine:
        pin = engine.pin(SYSTEM, ["host"], owner="ops")
        assert pin["blocks"] == 6 and pin["owner"] == "ops"
        outputs, hits = _run(engine, rounds)
        assert hits == [24] * len(rounds)  # every request on it: the whole prompt from the host
        assert engine.stats()["offload_tier_evicted_blocks"] > 16  # everything else went round
        assert not _removed_from(engine, "CPU") & _system_hashes(engine)
        assert engine.admin.lookup(SYSTEM)["tiers"]["host"] == 24
        assert_same_outputs(outputs, want)
        # Unpinned, the next rounds' traffic takes it like any other block.
        assert engine.admin.unpin(SYSTEM, owner="ops")["unpinned"][0]["id"] == pin["id"]
        engine.generate([random_tokens(random.Random(9), 64)], SAMPLING)
        engine.drain()
        assert engine.admin.lookup(SYSTEM)["tiers"]["host"] == 0
        assert _system_hashes(engine) <= _removed_from(engine, "CPU")
        assert_quiescent(engine)


def test_without_a_pin_the_same_pressure_evicts_the_system_prompt() -> None:
    """The control: the workload above does evict the prompt when it is not pinned."""
    with _engine() as engine:
        engine.warm(SYSTEM)
        _, hits = _run(engine, _workload())
        assert min(hits) < 24
        assert _system_hashes(engine) & _removed_from(engine, "CPU")


def test_a_pin_past_the_quota_is_refused_and_nothing_is_pinned() -> None:
    with _engine(kv_pin_quota=0.25) as engine:  # 4 of 16 host blocks
        with pytest.raises(PinQuotaExceeded, match="host tier's pinned quota is 4 blocks"):
            engine.pin(SYSTEM, ["host"])
        assert engine.admin.pins()["pins"] == []
        assert engine.admin.lookup(SYSTEM)["tiers"]["host"] == 0  # refused before computing
        engine.pin(SYSTEM[:16], ["host"])
        assert engine.admin.pins()["pinned_blocks"] == {"host": 4}
        engine.admin.unpin(owner="operator")
        assert_quiescent(engine)


def test_warming_makes_the_first_request_a_full_hit() -> None:
    with _engine() as engine:
        engine.warm(SYSTEM)
        engine.admin.clear(["device"])
        out = engine.generate([[*SYSTEM, 5, 6, 7, 8, 9]], SAMPLING)[0]
        assert out.cached_tokens_offload == 24 and out.cached_tokens_engine == 0


def test_warming_promotes_from_disk_into_the_host(tmp_path: Path) -> None:
    with _engine(kv_disk_path=str(tmp_path), kv_disk_size=_disk_gib(100)) as engine:
        engine.warm(SYSTEM, ["disk"])
        engine.admin.clear(["device", "host"])
        assert engine.admin.lookup(SYSTEM)["tiers"] == {"device": 0, "host": 0, "disk": 24}
        engine.warm(SYSTEM, ["host"])
        assert engine.admin.lookup(SYSTEM)["tiers"] == {"device": 24, "host": 24, "disk": 24}
        # The first five came up from disk; the last holds the prompt's last token, which a
        # request always computes (its logits), and was stored again.
        assert engine.stats()["offload_tier_promoted_blocks"] == 5


def test_clears_are_announced_counted_and_equal_the_index(tmp_path: Path) -> None:
    prompts = [p for r in _workload(3, rounds=3) for p in r]
    with _engine(kv_disk_path=str(tmp_path), kv_disk_size=_disk_gib(100)) as engine:
        engine.generate(prompts, SAMPLING)
        engine.drain()
        engine.pin(SYSTEM, ["host", "disk"])
        index = BlockIndex()
        collector: Any = engine.publisher

        def check_lookups() -> None:
            for batch in collector.batches[len(seen):]:
                index.apply(batch)
            seen.extend(collector.batches[len(seen):])
            as_int = engine.config.events.int_block_hashes
            for prompt in prompts:
                p = engine.admin.prompt(prompt)
                answer = engine.admin.lookup(prompt)
                hashes = [external_block_hash(offload_key_hash(k), as_int) for k in p.keys]
                for tier in ("host", "disk"):
                    assert answer["tiers"][tier] == 4 * index.prefix_length(hashes, tier), tier
                device = [external_block_hash(h, as_int) for h in p.device_hashes]
                assert answer["tiers"]["device"] == 4 * index.prefix_length(device, "device")

        seen: list[Any] = []
        check_lookups()
        before = {t: len(index.blocks(t)) for t in ("device", "host", "disk")}
        answer = engine.admin.clear(["device", "host", "disk"])
        removed = answer["removed_blocks"]
        assert removed == {t: before[t] - (6 if t != "device" else 0) for t in before}
        assert answer["kept_pinned_blocks"] == {"host": 6, "disk": 6}
        check_lookups()
        assert {t: len(index.blocks(t)) for t in ("host", "disk")} == {"host": 6, "disk": 6}
        assert engine.admin.cleared == removed
        # --unpin: the pinned blocks go too, announced as well.
        assert engine.admin.clear(unpin=True)["removed_blocks"] == {
            "device": 0, "host": 6, "disk": 6}
        check_lookups()
        assert all(not index.blocks(t) for t in ("device", "host", "disk"))


def test_disk_pins_survive_a_restart(tmp_path: Path) -> None:
    disk = {"kv_disk_path": str(tmp_path), "kv_disk_size": _disk_gib(20)}
    with _engine(**disk) as engine:
        engine.pin(SYSTEM, ["host", "disk"], owner="ops", ttl_s=3600)
    with _engine(**disk) as engine:
        pins = engine.admin.pins()
        assert [(p["owner"], p["tiers"], p["tokens"]) for p in pins["pins"]] == [
            ("ops", ["disk"], 24)]
        assert pins["pinned_blocks"]["disk"] == 6
        # 60 fresh blocks through a disk of 20: the pinned six stay on disk.
        for prompt in [random_tokens(random.Random(i), 40) for i in range(6)]:
            engine.generate([prompt], SAMPLING)
            engine.drain()
        assert engine.stats()["offload_tier_disk_evicted_blocks"] > 0
        assert engine.admin.lookup(SYSTEM)["tiers"]["disk"] == 24
        engine.admin.unpin(owner="ops")
    with _engine(**disk) as engine:
        assert engine.admin.pins()["pins"] == []


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda e: e.admin.lookup(""), "prompt"),
        (lambda e: e.admin.lookup([]), "prompt"),
        (lambda e: e.pin(SYSTEM, ["nvme"]), "tiers"),
        (lambda e: e.pin(SYSTEM, ["host"], ttl_s=-5), "ttl_s"),
        (lambda e: e.admin.clear(["gpu"]), "tiers"),
        (lambda e: e.admin.clear(model="not-hex"), "model"),
        (lambda e: e.warm(SYSTEM, ["remote"]), "tiers"),
        (lambda e: e.admin.unpin(), "unpin"),
    ],
)
def test_bad_input_is_one_clear_error(call: Any, field: str) -> None:
    with _engine() as engine:
        with pytest.raises(ConfigError) as err:
            call(engine)
        assert err.value.field == field
        assert engine.admin.pins()["pins"] == []


def _keys_under(client: Any, fingerprint: str) -> int:
    return len(client.keys(f"kvo:admin-clear:{fingerprint}:*".encode()))


def test_clear_by_model_leaves_other_models_blocks(tmp_path: Path, redis_server: Any) -> None:
    shared = {"kv_remote_url": redis_server.url + "?namespace=admin-clear",
              "kv_disk_path": str(tmp_path), "kv_disk_size": _disk_gib(100)}
    with redis_server.client() as client:
        with _engine(seed=1, **shared) as other:  # other weights: another fingerprint
            other.warm(SYSTEM)
            other_model = other.admin.model
        with _engine(**shared) as engine:
            engine.warm(SYSTEM)
            own = engine.admin.model
            assert own != other_model and other_model is not None and own is not None
            assert _keys_under(client, own) == _keys_under(client, other_model) == 6
            assert engine.admin.lookup(SYSTEM)["tiers"]["remote"] == 24
            # Its own model: this server's blocks go, on the shared server too; the other
            # model's stay, on disk and on Redis.
            answer = engine.admin.clear(["disk", "remote"])
            assert answer["removed_blocks"] == {"disk": 6, "remote": 6}
            assert _keys_under(client, own) == 0 and _keys_under(client, other_model) == 6
            assert engine.admin.lookup(SYSTEM)["tiers"] == {
                "device": 24, "host": 24, "disk": 0, "remote": 0}
            removed = _removed_from(engine, "STORAGE")
            assert _system_hashes(engine) <= removed
            assert (tmp_path / "kvoffload-v2" / other_model).is_dir()
            # The other model's namespace, by its fingerprint.
            answer = engine.admin.clear(["disk", "remote"], model=other_model)
            assert answer["removed_blocks"]["remote"] == 6 and answer["removed_blocks"]["disk"] >= 6
            assert _keys_under(client, other_model) == 0
            assert not (tmp_path / "kvoffload-v2" / other_model).exists()
            assert (tmp_path / "kvoffload-v2" / own).is_dir()
