"""The disk tier with compression on real files: exact round trips with fewer bytes, the bound
counted in the bytes of the files as stored (more blocks fit), damaged compressed files detected
and dropped, a full filesystem, warm restart with measured sizes, lossy blocks in a namespace of
their own, and the settings checked."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test
from test_tier_stateful import SETTINGS as STATEFUL_SETTINGS
from test_tier_stateful import DiskTierMachine, small_disk_tier
from tier_cases import (
    BLOCK_BYTES,
    dir_bytes,
    dir_bytes_at_once,
    host_pool,
    key,
    small_tmpfs,
    tier_file,
    wait_jobs,
)

from kvoffload.errors import ConfigError
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers import KVLayout, TierJob
from kvoffload.tiers.blockformat import encode_header, header_size, payload_checksum
from kvoffload.tiers.codec.frame import LOSSLESS_ID, pack_frame_header
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import LEDGER_BYTES, DiskTier

CTX = ReqContext("test")
BLOCK = 64 * 1024
FILE = file_bytes(BLOCK)
FILE_2K = file_bytes(BLOCK_BYTES)  # a block file of the contract machine's tier
HIT, MISS = LookupResult.HIT, LookupResult.MISS
STATEFUL_DISK_BLOCKS = 5


def kv_layout(block_bytes: int = BLOCK) -> KVLayout:
    return KVLayout("test-model", "torch.bfloat16", 16, 2, 2, 64, block_bytes)


def kv_pool(num_slots: int, seed: int = 0) -> tuple[torch.Tensor, memoryview]:
    """A host pool of bf16 KV-like values (normal, a few channels 8x larger)."""
    g = torch.Generator().manual_seed(seed)
    count = num_slots * BLOCK // 2
    values = torch.randn(count, generator=g) * (1 + 7 * (torch.arange(count) % 64 == 5))
    tensor = values.to(torch.bfloat16).view(torch.uint8).view(num_slots, BLOCK).clone()
    return tensor, memoryview(tensor.numpy())  # type: ignore[arg-type]


def tier(path: Path, pool: memoryview, raw_files: int = 16, **settings: Any) -> DiskTier:
    """A disk tier whose bound holds ``raw_files`` uncompressed block files."""
    settings.setdefault("rescan_interval", 0)
    settings.setdefault("compression", "lossless")
    bound = LEDGER_BYTES + raw_files * FILE
    return DiskTier(pool, kv_layout(), DiskTierSettings(path, bound, **settings))


def run(t: DiskTier, job_id: int, store: bool, keys: list[Any], slots: list[int]) -> dict[Any, str]:
    (t.submit_store if store else t.submit_load)(TierJob(job_id, keys, slots))
    (result,) = wait_jobs(t)
    assert result.job_id == job_id
    return result.failed_keys


def test_lossless_round_trip_is_exact_and_smaller(tmp_path: Path) -> None:
    pool, view = kv_pool(8)
    t = tier(tmp_path, view)
    try:
        assert run(t, 1, True, [key(i) for i in range(4)], [0, 1, 2, 3]) == {}
        assert run(t, 2, False, [key(3), key(0)], [4, 5]) == {}
        assert torch.equal(pool[4], pool[3]) and torch.equal(pool[5], pool[0])
        size = tier_file(tmp_path, key(0)).stat().st_size
        assert size < header_size(len(key(0))) + BLOCK / 1.3
        stats = t.stats()
        assert (
            stats["codec_raw_bytes"] > 1.3 * stats["codec_stored_bytes"]
            and stats["codec_decoded_blocks"] == 2
        )
        assert stats["used_bytes"] == dir_bytes(tmp_path) == stats["dir_used_bytes"]
        t.check_ledger()
    finally:
        t.close()


def test_the_bound_counts_stored_bytes_and_holds_more_blocks(tmp_path: Path) -> None:
    """A bound of 12 raw files: compressed, more blocks fit, and the files never exceed it."""
    pool, view = kv_pool(48)
    bound = LEDGER_BYTES + 12 * FILE
    t = tier(tmp_path, view, raw_files=12)
    try:
        for j in range(6):
            keys = [key(8 * j + i) for i in range(8)]
            run(t, j + 1, True, keys, list(range(8 * j, 8 * j + 8)))
            assert dir_bytes(tmp_path) <= bound
            t.check_ledger()
        held = [i for i in range(48) if t.lookup(key(i), CTX) is HIT]
        assert len(held) >= 16, len(held)  # 12 raw files' bytes hold 16+ compressed blocks
        pool_copy = pool.clone()
        pool[:8].zero_()
        assert run(t, 99, False, [key(i) for i in held[:8]], list(range(8))) == {}
        assert torch.equal(pool[:8], pool_copy[held[:8]])
    finally:
        t.close()


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10
    path.write_bytes(bytes(raw))


def _undecodable(path: Path) -> None:
    """A frame whose checksum is right but whose plane table lies (a buggy writer); the file
    keeps its size (as the ledger counted it)."""
    k = bytes.fromhex(path.name[: -len(".kvb")])
    head_len = header_size(len(k))
    stored = len(path.read_bytes()) - head_len
    frame = pack_frame_header(LOSSLESS_ID, 2, BLOCK) + bytes(stored - 8)
    head = encode_header(
        kv_layout().fingerprint(), k, len(frame), payload_checksum(frame), encoded=True
    )
    path.write_bytes(head + frame)


@pytest.mark.parametrize("damage,cause", [(_flip, "checksum"), (_undecodable, "corrupt")])
def test_a_damaged_compressed_file_fails_its_load_and_is_dropped(
    tmp_path: Path,
    damage: Callable[[Path], None],
    cause: str,
) -> None:
    pool, view = kv_pool(6)
    t = tier(tmp_path, view)
    try:
        assert run(t, 1, True, [key(0), key(1)], [0, 1]) == {}
        damage(tier_file(tmp_path, key(0)))
        pool[2:4].fill_(0xEE)
        assert run(t, 2, False, [key(0), key(1)], [2, 3]) == {key(0): cause}
        assert torch.equal(pool[3], pool[1])
        assert t.lookup(key(0), CTX) is MISS  # dropped: the engine recomputes it
        assert not list(tmp_path.rglob(key(0).hex() + ".kvb"))
        assert t.stats()[f"failed_load_{cause}"] == 1
        t.check_ledger()
    finally:
        t.close()


def test_encode_failures_store_raw_and_log_once_per_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A codec that fails every block (an injected fault): each block is stored as it is and
    loads back exact; the store logs one error, counted, not one traceback per block."""
    pool, view = kv_pool(10)
    t = tier(tmp_path, view)

    def broken(raw: memoryview) -> bytes | None:
        raise RuntimeError("codec broke")

    monkeypatch.setattr(t.codec, "encode", broken)
    keys = [key(i) for i in range(5)]
    try:
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            assert run(t, 1, True, keys, [0, 1, 2, 3, 4]) == {}
        failures = [r for r in caplog.records if "encoding" in r.getMessage()]
        assert len(failures) == 1
        assert "5 of 5 blocks" in failures[0].getMessage()
        assert failures[0].exc_info is not None
        assert run(t, 2, False, keys, [5, 6, 7, 8, 9]) == {}
        assert torch.equal(pool[5:10], pool[0:5])
    finally:
        t.close()


def test_no_space_from_the_os_fails_compressed_stores_cleanly(tmp_path: Path) -> None:
    def no_space(op: str, k: bytes) -> None:
        if op == "write" and k == key(2):
            raise OSError(errno.ENOSPC, "No space left on device")

    _pool, view = kv_pool(4)
    t = tier(tmp_path, view, fault_hook=no_space)
    try:
        assert run(t, 1, True, [key(1), key(2), key(3)], [0, 1, 2]) == {key(2): "full"}
        assert t.lookup(key(2), CTX) is MISS and t.lookup(key(3), CTX) is HIT
        assert t.stats()["dir_used_bytes"] == dir_bytes(tmp_path)
        t.check_ledger()
    finally:
        t.close()


def test_a_really_full_filesystem_fails_compressed_stores_cleanly(tmp_path: Path) -> None:
    """A 512 KiB tmpfs under a larger bound (skips unless root)."""
    with small_tmpfs(tmp_path / "small", "512k") as mount:
        pool, view = kv_pool(24)
        t = tier(mount, view, raw_files=24)
        try:
            failed = run(t, 1, True, [key(i) for i in range(24)], list(range(24)))
            assert failed and set(failed.values()) == {"full"}
            stored = [i for i in range(24) if t.lookup(key(i), CTX) is HIT]
            assert stored and len(stored) + len(failed) == 24
            assert not list(mount.rglob("*.tmp"))
            assert run(t, 2, False, [key(stored[0])], [0]) == {}
            assert torch.equal(pool[0], pool[stored[0]])
        finally:
            t.close()


def test_warm_restart_measures_the_files(tmp_path: Path) -> None:
    pool, view = kv_pool(8)
    t = tier(tmp_path, view)
    try:
        assert run(t, 1, True, [key(i) for i in range(5)], list(range(5))) == {}
        used = t.stats()["used_bytes"]
    finally:
        t.close()
    again = tier(tmp_path, view)
    try:
        assert again.stats()["used_blocks"] == 5 and again.stats()["used_bytes"] == used
        assert run(again, 2, False, [key(4)], [7]) == {}
        assert torch.equal(pool[7], pool[4])
        again.check_ledger()
    finally:
        again.close()


def test_lossy_raw_and_lossless_tiers_never_read_each_others_files(tmp_path: Path) -> None:
    """Three live tiers of one model on one directory (each keeps the others' namespaces: they
    are in use) each find only their own blocks."""
    pool, view = kv_pool(8)
    modes = ("none", "lossless", "fp8")
    tiers: list[DiskTier] = []
    try:
        for i, mode in enumerate(modes):
            tiers.append(tier(tmp_path, view, compression=mode))
            assert run(tiers[i], 1, True, [key(10 + i)], [i]) == {}
        for i, t in enumerate(tiers):
            assert [t.lookup(key(10 + j), CTX) is HIT for j in range(3)] == [
                j == i for j in range(3)
            ]
        assert run(tiers[2], 2, False, [key(12)], [5]) == {}
        want, got = (
            pool[2].view(torch.bfloat16).float(),
            pool[5].view(torch.bfloat16).float(),
        )
        assert not torch.equal(got, want)
        assert bool(((got - want).abs() <= want.abs() / 16 + want.abs() / 128 + 1e-3).all())
    finally:
        for t in tiers:
            t.close()


def test_compression_settings_are_checked(tmp_path: Path) -> None:
    _pool, view = kv_pool(2)
    with pytest.raises(ConfigError, match="kv_disk_compression"):
        tier(tmp_path, view, compression="gzip")
    with pytest.raises(ConfigError, match="kv_disk_compression"):
        tier(tmp_path, view, o_direct=True)


def test_compression_is_off_unless_configured(tmp_path: Path) -> None:
    _pool, view = kv_pool(2)
    bound = LEDGER_BYTES + 4 * FILE
    t = DiskTier(view, kv_layout(), DiskTierSettings(tmp_path, bound, rescan_interval=0))
    try:
        assert run(t, 1, True, [key(0)], [0]) == {}
        assert tier_file(tmp_path, key(0)).stat().st_size == FILE
        assert t.stats()["codec_encoded_blocks"] == 0
    finally:
        t.close()


class CompressedDiskTierMachine(DiskTierMachine):
    """The disk tier's contract machine (``test_tier_stateful.py``) on a ``lossless`` tier of
    the same bound: its blocks compress well, so more blocks fit than raw, and the files
    (measured) never exceed the bound; the ledger equals them after every drain."""

    compression = "lossless"


def test_compressed_disk_tier_contract() -> None:
    run_state_machine_as_test(CompressedDiskTierMachine, settings=STATEFUL_SETTINGS)


def test_a_walk_spanning_an_eviction_counts_a_file_more_than_the_directory_held(
    tmp_path: Path,
) -> None:
    """Why the contract machine measures the bound with the ledger locked
    (``dir_bytes_at_once``): a full compressed tier unlinks its victim and writes its new block
    into another file, so a walk that saw the victim before the store and the new file after
    counts one file more than the bound, though the directory never held more; at every
    instant it holds at most the bound."""
    pool = host_pool(8)
    t = small_disk_tier(tmp_path, pool, compression="lossless")
    try:
        t.submit_store(TierJob(1, [key(i) for i in range(5)], list(range(5))))
        wait_jobs(t)
        assert dir_bytes(tmp_path) == dir_bytes_at_once(t, tmp_path) == t.capacity_bytes
        victim = tier_file(tmp_path, key(0))  # the least recently used
        seen = {victim.stat().st_ino: FILE_2K}  # a walk's first part: the victim is there
        t.submit_store(TierJob(2, [key(5)], [5]))
        wait_jobs(t)
        assert not victim.exists() and t.lookup(key(0), CTX) is MISS
        for path in tmp_path.rglob("*.kvb"):  # the rest of the walk: the new file too
            seen[path.stat().st_ino] = FILE_2K
        assert LEDGER_BYTES + sum(seen.values()) == t.capacity_bytes + FILE_2K
        assert dir_bytes(tmp_path) == dir_bytes_at_once(t, tmp_path) == t.capacity_bytes
        t.check_ledger()
    finally:
        t.close()


def test_switching_to_lossless_reclaims_raw_files_once_no_live_tier_uses_them(
    tmp_path: Path,
) -> None:
    """A raw tier's files are outside a lossless tier's namespace and bound, and it never reads
    them: while a raw tier still runs they are left alone (it loads its blocks intact); once
    it is gone, the lossless tier's reclaim removes them, and the directory holds only what
    the lossless tier counts. The next raw tier likewise removes the lossless namespace."""
    pool, view = kv_pool(8)
    raw = tier(tmp_path, view, compression="none")
    raw_namespace = raw.namespace
    try:
        assert run(raw, 1, True, [key(i) for i in range(4)], [0, 1, 2, 3]) == {}
        lossless = tier(tmp_path, view)
        try:
            assert lossless._old_namespaces.in_use == 1  # the raw tier is live: kept
            assert run(raw, 2, False, [key(3)], [4]) == {}
            assert torch.equal(pool[4], pool[3])
            assert run(lossless, 3, True, [key(i) for i in range(4, 6)], [0, 1]) == {}
        finally:
            raw.close()
        try:
            assert raw_namespace.exists()
            lossless._old_namespaces.reclaim()  # what the rescan does while one is in use
            assert not raw_namespace.exists()
            assert lossless._old_namespaces.in_use == 0
            assert lossless._old_namespaces.removed_files >= 4
            assert lossless.stats()["used_bytes"] == dir_bytes(tmp_path)
            assert run(lossless, 4, False, [key(4)], [5]) == {}
            assert torch.equal(pool[5], pool[0])
            lossless_namespace = lossless.namespace
        finally:
            lossless.close()
        again = tier(tmp_path, view, compression="none")
        try:
            assert not lossless_namespace.exists() and again._old_namespaces.in_use == 0
            assert again.stats()["used_bytes"] == dir_bytes(tmp_path)
        finally:
            again.close()
    finally:
        raw.close()
