"""The engine with a disk tier behind the host tier: outputs equal a run without offloading in
every case (promotions, warm restart, damaged files, a full disk, a killed writer, two engine
processes on one directory), and bad settings are clear errors."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from engine_cases import (
    EventCollector,
    assert_quiescent,
    assert_same_outputs,
    cycling_rounds,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401  (autouse fixture)
    random_mix,
    reference_outputs,
    run_rounds,
    tiny_engine,
)
from tier_cases import dir_bytes, small_tmpfs

from kvoffload.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.events.block_index import BlockIndex
from kvoffload.events.messages import BlockStored, external_block_hash
from kvoffload.keys import OffloadKey, offload_key_hash
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers.blockformat import CorruptBlockError, parse_header, verify_payload
from kvoffload.tiers.disk.tier import DiskTier

TESTS = Path(__file__).parent
HIT = LookupResult.HIT
#: The tiny preset's file per offloaded block: 4 KiB header + 2 KiB payload in a 4 KiB block.
FILE = 8192
LEDGER = 4096


def disk_gib(blocks: int) -> float:
    return (LEDGER + blocks * FILE) / 2**30


ROUNDS = cycling_rounds(num_prefixes=8, prefix_blocks=6, num_rounds=3)
SAMPLING = greedy(max_tokens=4)


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_outputs([p for r in ROUNDS for p in r], SAMPLING)


def disk_engine(path: Path, **kwargs: Any) -> Engine:
    """Device cache for fewer than all prefixes, host tier for a third of them, disk for all.
    Requests wait for their promotions however slow the I/O threads are (a loaded machine must
    not turn a promotion into a recompute and change what the tests count), within their lookup
    (``kv_promotion_wait_s``: a disk hit loads in the step it is found, whatever the timing)."""
    options: dict[str, Any] = {
        "num_device_blocks": 40,
        "kv_lookup_retry_s": 600.0,
        "kv_promotion_wait_s": 60.0,
        "kv_offloading_size": host_gib(16),
        "kv_disk_path": str(path),
        "kv_disk_size": disk_gib(200),
    }
    options.update(kwargs)
    return tiny_engine(**options)


def _disk_tier(engine: Engine) -> DiskTier:
    """The engine's disk tier (its first secondary tier here)."""
    assert engine.tiering is not None
    disk = engine.tiering.tiers[0]
    assert isinstance(disk, DiskTier)
    return disk


def block_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvb"))


def one_at_a_time(
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams | list[SamplingParams] = SAMPLING,
) -> list[RequestOutput]:
    """Each prompt alone, the engine's transfers and the tiers' jobs drained after it.

    Run together, which prefixes reach the disk at all depends on when the cascades' disk writes
    report (a cascade pins its host slots until then, and the host refuses stores meanwhile), and
    which promotions find host room on when the transfers holding it report. Alone, a request's
    lookup meets a drained host whose slots are free or evictable: every prefix is cascaded, and
    every disk hit is promoted. (Run together deterministically:
    ``test_bug_a_round_run_together_promotes_instead_of_recomputing``.)"""
    outputs = []
    params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    for prompt, param in zip(prompts, params, strict=True):
        outputs.extend(engine.generate([prompt], param))
        engine.drain()
    return outputs


def test_prefixes_beyond_the_host_tier_come_back_from_disk(tmp_path: Path, reference) -> None:
    with disk_engine(tmp_path) as engine:
        outputs = [o for r in ROUNDS for o in one_at_a_time(engine, r)]
        stats = engine.stats()
    assert_same_outputs(outputs, reference)
    assert stats["offload_tier_promoted_blocks"] > 0
    assert stats["offload_tier_refused_promotion_blocks"] == 0  # alone, a request finds room
    # Requests waited for their promotions within their lookups: no step was lost to a RETRY.
    assert stats["offload_tier_awaited_promotions_landed"] > 0
    assert stats["offload_retries"] == 0
    assert stats["offload_tier_disk_loaded_blocks"] == stats["offload_tier_promoted_blocks"]
    assert stats["offload_tier_disk_failed_load_blocks"] == 0
    # Some request of the later rounds got its prefix from the offloaded tiers.
    assert sum(o.cached_tokens_offload for o in outputs[8:]) > 0


def test_bug_a_round_run_together_promotes_instead_of_recomputing(
    tmp_path: Path, reference
) -> None:
    """Regression: a round's eight requests admitted together, each prefix on disk only. Two bugs
    made most of them recompute: every deferred request let the one behind it be looked up, so
    each request of the round started a promotion the host had no room for (refused: recomputed),
    and a promotion reserved its slots at ``step_end``, after the same step's device stores took
    them. Now promotions go first, and a request waiting for one keeps the device blocks it will
    need, so requests the pool cannot admit yet start no promotion. Deterministic: transfers
    report one step late and the disk's jobs are drained after every step."""
    with disk_engine(tmp_path) as engine:
        delay_completions(engine, lambda _: 0)
        assert engine.tiering is not None
        disk = engine.tiering.tiers[0]
        outputs = one_at_a_time(engine, ROUNDS[0])  # every prefix reaches the disk
        before = engine.stats()
        for prompts in ROUNDS[1:]:
            ids = [engine.add_request(p, SAMPLING) for p in prompts]
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                done.update((o.request_id, o) for o in engine.step())
                disk.drain_jobs()
            outputs.extend(done[i] for i in ids)
        stats = engine.stats()
        assert_quiescent(engine)
    assert_same_outputs(outputs, reference)
    assert stats["offload_tier_refused_promotion_blocks"] == 0
    assert stats["offload_tier_pinned_promoted_blocks"] == 0
    promoted = stats["offload_tier_promoted_blocks"] - before["offload_tier_promoted_blocks"]
    disk_tokens = stats["offload_hit_tokens_disk"] - before.get("offload_hit_tokens_disk", 0)
    assert promoted > 0
    assert disk_tokens == promoted * 4  # every promoted block was loaded by its request


@pytest.mark.parametrize("cascade", ["write_through", "on_evict"])
def test_cascade_modes_give_identical_outputs(tmp_path: Path, reference, cascade: str) -> None:
    with disk_engine(tmp_path, kv_tier_cascade=cascade) as engine:
        outputs = [o for r in run_rounds(engine, ROUNDS, SAMPLING) for o in r]
        stats = engine.stats()
    assert_same_outputs(outputs, reference)
    assert stats["offload_tier_cascaded_blocks"] > 0


def test_warm_restart_serves_hits_on_the_first_requests(tmp_path: Path, reference) -> None:
    with disk_engine(tmp_path) as engine:
        one_at_a_time(engine, ROUNDS[0])
    with disk_engine(tmp_path) as engine:
        assert engine.stats()["offload_tier_disk_scanned_blocks"] > 0
        outputs = one_at_a_time(engine, ROUNDS[1])
    assert_same_outputs(outputs, reference[8:16])
    assert outputs[0].cached_tokens_offload > 0


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 1000])  # the payload cut short


@pytest.mark.parametrize(("damage", "cause"), [(_flip, "checksum"), (_truncate, "corrupt")])
def test_damaged_files_are_recomputed_and_counted(
    tmp_path: Path, reference, damage, cause: str
) -> None:
    with disk_engine(tmp_path) as engine:
        one_at_a_time(engine, ROUNDS[0])  # every prefix reaches the disk
    files = block_files(tmp_path)
    assert len(files) >= len(ROUNDS[0]) * 6
    for path in files:
        damage(path)
    with disk_engine(tmp_path) as engine:
        outputs = one_at_a_time(engine, ROUNDS[1])  # every prefix is promoted: its files read
        stats = engine.stats()
        # Bad files that were asked for were dropped (and rewritten from the recomputed KV).
        assert _count_bad_files(tmp_path, engine) < len(files)
    assert_same_outputs(outputs, reference[8:16])
    assert stats[f"offload_tier_disk_failed_load_{cause}"] > 0
    assert stats["offload_tier_promoted_blocks"] == 0


def test_another_models_blocks_are_never_served(tmp_path: Path, reference) -> None:
    """Blocks of the same tokens from a model with other weights, planted under our names."""
    with disk_engine(tmp_path, seed=1) as other:  # other random weights: another fingerprint
        one_at_a_time(other, ROUNDS[0])
        other_ns = other.tiering.tiers[0].namespace  # type: ignore[union-attr]
    with disk_engine(tmp_path) as engine:
        mine = engine.tiering.tiers[0].namespace  # type: ignore[union-attr]
    assert mine != other_ns
    for path in other_ns.rglob("*.kvb"):
        target = mine / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, target)
    with disk_engine(tmp_path) as engine:
        outputs = one_at_a_time(engine, ROUNDS[1])
        stats = engine.stats()
    assert_same_outputs(outputs, reference[8:16])
    assert stats["offload_tier_disk_failed_load_layout"] > 0
    assert stats["offload_tier_promoted_blocks"] == 0


def test_full_disk_fault_hook_keeps_serving(tmp_path: Path, reference) -> None:
    import errno

    def no_space(op: str, key: bytes) -> None:
        if op == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    with disk_engine(tmp_path) as engine:
        engine.tiering.tiers[0]._files.fault_hook = no_space  # type: ignore[union-attr]
        outputs = [o for r in run_rounds(engine, ROUNDS, SAMPLING) for o in r]
        stats = engine.stats()
    assert_same_outputs(outputs, reference)
    assert stats["offload_tier_disk_failed_store_full"] > 0
    assert stats["offload_tier_disk_stored_blocks"] == 0
    assert not block_files(tmp_path) and not list(tmp_path.rglob("*.tmp"))


def test_full_filesystem_keeps_serving(tmp_path: Path, reference) -> None:
    """160 KiB free on a 2 MiB tmpfs behind a 1.6 MiB bound: the OS says ENOSPC (skips unless
    root)."""
    with small_tmpfs(tmp_path / "small", "2m", free_kib=160) as mount:
        with disk_engine(mount) as engine:
            outputs = [o for r in run_rounds(engine, ROUNDS, SAMPLING) for o in r]
            stats = engine.stats()
        assert_same_outputs(outputs, reference)
        assert stats["offload_tier_disk_failed_store_full"] > 0
        assert stats["offload_tier_disk_stored_blocks"] > 0


def test_per_request_tier_selection(tmp_path: Path, reference) -> None:
    with disk_engine(tmp_path) as engine:
        one_at_a_time(engine, ROUNDS[0])
    with disk_engine(tmp_path) as engine:
        ids = [
            engine.add_request(p, SAMPLING, kv_transfer_params={"kv_load_tiers": []})
            for p in ROUNDS[1]
        ]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in engine.step():
                done[out.request_id] = out
        stats = engine.stats()
        with pytest.raises(ConfigError, match="kv_load_tiers"):
            engine.add_request(ROUNDS[1][0], SAMPLING, kv_transfer_params={"kv_load_tiers": ["s3"]})
    assert_same_outputs([done[i] for i in ids], reference[8:16])
    assert stats["offload_tier_promoted_blocks"] == 0
    assert stats["offload_tier_disk_loaded_blocks"] == 0


def _count_bad_files(path: Path, engine: Engine) -> int:
    """Block files under ``path`` that fail the header or checksum checks."""
    fingerprint = engine.tiering.tiers[0].layout.fingerprint()  # type: ignore[union-attr]
    bad = 0
    for file in block_files(path):
        raw = file.read_bytes()
        try:
            header = parse_header(raw, fingerprint, bytes.fromhex(file.stem))
            verify_payload(header, raw[header.header_len :])
        except CorruptBlockError:
            bad += 1
    return bad


def _proc(path: Path, size: float, seed: int, rounds: int, out: Path, *extra: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [
            sys.executable,
            str(TESTS / "disk_engine_proc.py"),
            str(path),
            str(size),
            str(seed),
            str(rounds),
            str(out),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_writer_killed_mid_stores_leaves_no_partial_block(tmp_path: Path) -> None:
    proc = _proc(tmp_path / "tier", disk_gib(400), 10, 0, tmp_path / "unused.json", "--forever")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("round 3"):
                break
        else:
            pytest.fail(f"writer ended early: {proc.stderr.read() if proc.stderr else ''}")
        proc.send_signal(signal.SIGKILL)  # the next round's stores are in flight now
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes its pipes
    prompts, params = random_mix(10, num_prompts=10)
    for seed in (11, 12):
        more_prompts, more_params = random_mix(seed, num_prompts=10)
        prompts += more_prompts
        params += more_params
    want = reference_outputs(prompts, params)
    with tiny_engine(
        num_device_blocks=24,
        kv_offloading_size=host_gib(6),
        kv_disk_path=str(tmp_path / "tier"),
        kv_disk_size=disk_gib(400),
    ) as engine:
        assert block_files(tmp_path / "tier")
        assert _count_bad_files(tmp_path / "tier", engine) == 0  # no partial block, ever
        outputs = one_at_a_time(engine, prompts, params)  # each disk hit is promoted
        stats = engine.stats()
    assert_same_outputs(outputs, want)
    assert stats["offload_tier_disk_failed_load_blocks"] == 0
    assert stats["offload_tier_promoted_blocks"] > 0


def _snapshot_bytes(root: Path) -> int:
    """:func:`dir_bytes` taken while holding the tier's ledger lock: every unlink and every
    reservation happens under it, so no process frees or claims room during the walk and the
    walk is a snapshot (a walk without it can count a file evicted after it was seen and one
    written before it is reached, both)."""
    fds = [os.open(p, os.O_RDWR) for p in sorted(root.glob("kvoffload-v2/*/ledger"))]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX)
        return dir_bytes(root)
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock


def test_two_engine_processes_share_one_directory(tmp_path: Path) -> None:
    bound_blocks = 40
    size = disk_gib(bound_blocks)
    path = tmp_path / "tier"
    path.mkdir()
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _snapshot_bytes(path))
            stop.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        a = _proc(path, size, 20, 3, tmp_path / "a.json")
        b = _proc(path, size, 21, 3, tmp_path / "b.json")
        for proc in (a, b):
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err
    finally:
        stop.set()
        watcher.join()
    assert peak[0] <= LEDGER + bound_blocks * FILE
    assert dir_bytes(path) <= LEDGER + bound_blocks * FILE
    for name, first in (("a", 20), ("b", 21)):
        got = json.loads((tmp_path / f"{name}.json").read_text())
        for r, tokens in enumerate(got):
            prompts, params = random_mix(first + r, num_prompts=10)
            want = reference_outputs(prompts, params)
            assert tokens == [o.output_token_ids for o in want], f"{name} round {r}"


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"kv_disk_size": 0.0}, "kv_disk_size"),
        ({"kv_disk_size": -1.0}, "kv_disk_size"),
        ({"kv_disk_size": float("nan")}, "kv_disk_size"),
        ({"kv_offloading_size": 0.0}, "kv_disk_path"),
        ({"kv_tier_cascade": "sometimes"}, "kv_tier_cascade"),
        ({"kv_disk_eviction_policy": "nope"}, "kv_disk_eviction_policy"),
    ],
)
def test_bad_disk_settings_are_config_errors(tmp_path: Path, kwargs: dict, setting: str) -> None:
    options: dict[str, Any] = {
        "kv_offloading_size": 0.01, "kv_disk_path": str(tmp_path), "kv_disk_size": 1.0}
    options.update(kwargs)
    with pytest.raises(ConfigError, match=setting):
        EngineConfig(**options)


def test_disk_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(ConfigError, match="kv_disk_path"):
        EngineConfig(kv_offloading_size=0.01, kv_disk_path=str(file), kv_disk_size=1.0)


def test_disk_smaller_than_one_block_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_disk_size"):
        disk_engine(tmp_path, kv_disk_size=FILE / 2**30)


def test_unwritable_disk_path_is_a_config_error(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="kv_disk_path"):
            EngineConfig(kv_offloading_size=0.01, kv_disk_path=str(locked / "t"), kv_disk_size=1.0)
        return
    with small_tmpfs(tmp_path / "ro", "64k") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with pytest.raises(ConfigError, match="kv_disk_path"):
            disk_engine(mount / "tier")


def test_events_show_which_blocks_are_on_disk(tmp_path: Path) -> None:
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    with disk_engine(tmp_path, kv_disk_size=disk_gib(30), kv_events_config=events) as engine:
        collector = EventCollector()
        engine.publisher = collector
        run_rounds(engine, ROUNDS, SAMPLING)
        engine.drain()
        disk = _disk_tier(engine)
        as_int = engine.config.events.int_block_hashes  # as the events publish them
        on_disk = {
            external_block_hash(offload_key_hash(k), as_int)
            for k in disk._policy if disk.lookup(k, ReqContext("probe")) is HIT
        }
        evicted = engine.stats()["offload_tier_disk_evicted_blocks"]
    index = BlockIndex()
    stored = []
    for batch in collector.batches:
        index.apply(batch)
        stored += [e for e in batch.events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert evicted > 0  # removals were published too
    assert index.blocks("disk") == on_disk
    assert all(e.locality == "LOCAL" for e in stored)
    assert all(e.token_ids and e.block_size == 4 for e in stored)  # self-describing


def test_events_after_a_warm_restart_show_the_blocks_already_on_disk(tmp_path: Path) -> None:
    """A new engine announces the blocks its disk tier found at start (once, at its first step),
    so ``kvoffload events listen --index`` shows them without waiting for new stores."""
    with disk_engine(tmp_path) as engine:
        one_at_a_time(engine, ROUNDS[0])
    found = {offload_key_hash(OffloadKey(bytes.fromhex(p.stem))) for p in block_files(tmp_path)}
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    with disk_engine(tmp_path, kv_events_config=events) as engine:
        collector = EventCollector()
        engine.publisher = collector
        one_at_a_time(engine, ROUNDS[1][:1])
        first = BlockIndex()
        first.apply(collector.batches[0])
        run_rounds(engine, ROUNDS[1:], SAMPLING)
        engine.drain()
        disk = _disk_tier(engine)
        as_int = engine.config.events.int_block_hashes  # as the events publish them
        on_disk = {
            external_block_hash(offload_key_hash(k), as_int)
            for k in disk._policy if disk.lookup(k, ReqContext("probe")) is HIT
        }
    announced = {external_block_hash(h, as_int) for h in found}
    assert found and first.blocks("disk") == announced  # announced at the first step
    index = BlockIndex()
    for batch in collector.batches:
        index.apply(batch)
    assert index.blocks("disk") == on_disk


def test_disk_hits_are_counted_by_source_in_stats_and_metrics(tmp_path: Path, reference) -> None:
    """A warm restart loads its first prefix from disk: the tokens count as ``disk`` in the
    connector's counters, in tokens by source and in the scraped ``tier="disk"`` series."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvoffload.metrics.stats import tokens_by_source

    with disk_engine(tmp_path) as engine:
        one_at_a_time(engine, ROUNDS[0])
    with disk_engine(tmp_path) as engine:
        outputs = one_at_a_time(engine, ROUNDS[1])
        stats, tiers = engine.snapshot()
        text = generate_latest(engine.metrics.registry).decode()
    assert_same_outputs(outputs, reference[8:16])
    assert set(tiers) == {"host", "disk"}
    assert stats["offload_hit_tokens_disk"] > 0
    assert tokens_by_source(stats)["disk"] == stats["offload_hit_tokens_disk"]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert (
        samples[("kvoffload_tokens_by_source_total", (("source", "disk"),))]
        == (stats["offload_hit_tokens_disk"])
    )
    disk_series = [k for k in samples if ("tier", "disk") in k[1]]
    assert disk_series, "no tier=disk series"
    promotions = stats["offload_tier_promotion_jobs"]
    assert promotions > 0
    assert samples[("kvoffload_tier_promotion_seconds_count", ())] == promotions
