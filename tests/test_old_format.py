"""Blocks of the previous format (a model named by its path) never occupy a shared tier for good
(issue 18): on real files and a real ``redis-server``.

Disk: the previous release kept its namespaces under ``kvoffload-v1``; a tier of today removes
each of them that no process uses, at start and, for one in use then, once its users ended,
never while another live process reads it. Redis: the server governs its memory; values of the
previous format are never read again, so they expire with their TTL, or a server with an
eviction policy evicts them first as new blocks arrive.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest
from redis_servers import standalone_server
from remote_cases import (
    fill_random,
    keys_for,
    make_layout,
    make_pool,
    make_tier,
    run_job,
    wait_until,
)
from tier_cases import BLOCK_BYTES, disk_tier, fill_slot, host_pool, key, layout, wait_jobs

from kvoffload.tiers import TierJob
from kvoffload.tiers.disk import directory as diskdir
from kvoffload.tiers.disk import reclaim as diskreclaim
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import LEDGER_BYTES, DiskTier
from kvoffload.tiers.redis.config import remote_key_prefix

OLD_MODEL = "/models/llama"  # the previous format named a model by its path
NEW_MODEL = "kvo-model-v1:" + "0" * 32
OLD_DIR = "kvoffload-v1"


def old_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process writes as the previous release did: its directory, no reclaiming."""
    monkeypatch.setattr(diskdir, "FORMAT_DIR", OLD_DIR)
    monkeypatch.setattr(diskreclaim, "OLD_FORMAT_DIRS", ())


def store(tier: DiskTier, keys: list, slots: list[int]) -> None:
    tier.submit_store(TierJob(len(keys), keys, slots))
    assert all(r.success for r in wait_jobs(tier))


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_old_namespaces_nobody_uses_are_removed_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = host_pool(8)
    for i in range(8):
        fill_slot(pool, i, seed=i)
    with monkeypatch.context() as patch:
        old_release(patch)
        for model in (OLD_MODEL, "tiny@seed0"):  # two models of the old release
            bound = LEDGER_BYTES + 16 * file_bytes(BLOCK_BYTES)
            settings = DiskTierSettings(tmp_path, bound, rescan_interval=0)
            old = DiskTier(pool, layout(model), settings)
            store(old, [key(i) for i in range(8)], list(range(8)))
            old.close()
    namespaces = sorted((tmp_path / OLD_DIR).iterdir())
    assert len(namespaces) == 2 and all(len(files_under(ns)) >= 8 for ns in namespaces)
    # A removal a killed process left half done: renamed, not deleted yet.
    trash = tmp_path / OLD_DIR / ".reclaim.0123.99999"
    (trash / "ab").mkdir(parents=True)
    (trash / "ab" / "x.kvb").write_bytes(b"x")

    new = disk_tier(tmp_path, pool)
    try:
        assert not (tmp_path / OLD_DIR).exists()
        assert new._old_namespaces.removed_files >= 2 * 8 + 1
        store(new, [key(0)], [0])  # the new tier works as usual
        new.check_ledger()
    finally:
        new.close()


HOLDER = """
import sys
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk import directory as diskdir
from kvoffload.tiers.disk import reclaim as diskreclaim
from kvoffload.tiers.disk.tier import DiskTier
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.contract import KVLayout
from kvoffload.keys import make_offload_key
diskdir.FORMAT_DIR, diskreclaim.OLD_FORMAT_DIRS = "kvoffload-v1", ()  # the previous release
root, block = sys.argv[1], int(sys.argv[2])
pool = memoryview(bytearray(8 * block)).cast("B", (8, block))
pool.cast("B")[:] = bytes(range(256)) * (8 * block // 256)
layout = KVLayout("/models/llama", "float32", 4, 2, 2, 16, block)
tier = DiskTier(pool, layout, DiskTierSettings(root, 2**20, rescan_interval=0))
keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(8)]
tier.submit_store(TierJob(1, keys, list(range(8))))
tier.drain_jobs()
assert all(r.success for r in tier.get_finished_jobs())
print("stored", flush=True)
sys.stdin.readline()  # another engine of today starts meanwhile
expected = bytes(pool)
pool.cast("B")[:] = bytes(len(expected))
tier.submit_load(TierJob(2, keys, list(range(8))))
tier.drain_jobs()
(result,) = tier.get_finished_jobs()
print("loaded", not result.failed_keys and bytes(pool) == expected, flush=True)
sys.stdin.readline()
tier.close()
"""


def test_an_old_namespace_in_use_is_kept_until_its_users_end(tmp_path: Path) -> None:
    """A live process of the previous release keeps its namespace (its loads read every block
    intact after a tier of today started beside it); once it ends, the rescan removes it."""
    command = [sys.executable, "-c", HOLDER, str(tmp_path), str(BLOCK_BYTES)]
    with subprocess.Popen(command, stdin=PIPE, stdout=PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdin is not None
            assert holder.stdout.readline().strip() == "stored"
            (namespace,) = (tmp_path / OLD_DIR).iterdir()
            before = sorted(files_under(namespace))
            new = disk_tier(tmp_path, host_pool(4), rescan_interval=0.05)
            try:
                assert new._old_namespaces.in_use == 1
                assert sorted(files_under(namespace)) == before
                holder.stdin.write("\n")
                holder.stdin.flush()
                assert holder.stdout.readline().strip() == "loaded True"
                time.sleep(0.2)  # rescans tick while the holder still runs: nothing removed
                assert sorted(files_under(namespace)) == before
                holder.stdin.close()
                assert holder.wait(timeout=30) == 0
                gone = lambda: not new._old_namespaces.in_use  # noqa: E731
                wait_until(gone, "the old namespace removed by a rescan")
                assert not (tmp_path / OLD_DIR).exists()
            finally:
                new.close()
        finally:
            if holder.poll() is None:
                holder.kill()


def test_old_redis_values_expire_with_their_ttl() -> None:
    """Values the previous release stored with a TTL leave the server at their expiry, whether
    or not anything of today reads the same keys."""
    with standalone_server() as server:
        tensor, pool = make_pool(16)
        fill_random(tensor)
        old = make_tier(server.url, pool, make_layout(OLD_MODEL), ttl_s=0.5)
        keys = keys_for(16)
        assert not run_job(old, True, keys, list(range(16))).failed_keys
        old.close()
        new = make_tier(server.url, pool, make_layout(NEW_MODEL))
        try:
            assert not run_job(new, True, keys, list(range(16))).failed_keys
            with server.client() as client:
                wait_until(lambda: client.dbsize() == 16, "the old values expired")
                prefix = remote_key_prefix(make_layout(NEW_MODEL))
                assert all(k.startswith(prefix) for k in client.scan_iter())
        finally:
            new.close()


def test_old_redis_values_are_evicted_first_by_an_eviction_policy() -> None:
    """Without a TTL, a server with ``maxmemory`` and ``allkeys-lru`` evicts the values of the
    previous format as the new blocks fill it: nothing reads them any more, so they are the
    least recently used (the new blocks' loads keep those fresh)."""
    limits = ("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    with standalone_server(extra_args=(*limits, "--maxmemory-samples", "10")) as server:
        tensor, pool = make_pool(64)
        fill_random(tensor)
        old = make_tier(server.url, pool, make_layout(OLD_MODEL))
        for salt in range(4):
            assert not run_job(old, True, keys_for(64, salt), list(range(64))).failed_keys
        old.close()
        with server.client() as client:
            old_keys = list(client.scan_iter())
        assert len(old_keys) >= 200
        # The server's LRU clock ticks once a second: the old values were stored a tick before
        # anything new (in use they are days older).
        time.sleep(1.5)
        new = make_tier(server.url, pool, make_layout(NEW_MODEL))
        try:
            for salt in range(100, 140):
                keys = keys_for(64, salt)
                assert not run_job(new, True, keys, list(range(64))).failed_keys
                run_job(new, False, keys, list(range(64)))
            with server.client() as client:
                assert client.exists(*old_keys) == 0
                assert client.dbsize() > 0
        finally:
            new.close()
