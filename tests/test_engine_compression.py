"""Engines with compressed tiers generate exactly what engines without offloading generate:
lossless blocks on disk and in Redis (standalone and Cluster, read by another process) come back
bit for bit; damaged compressed files and a full filesystem cost recomputation, never output;
lossy blocks exist only where configured."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from engine_cases import (
    assert_same_outputs,
    one_thread,  # noqa: F401  (autouse fixture)
    reference_outputs,
    run_rounds,
)
from redis_servers import RedisClusterServers, RedisServer
from test_engine_disk import ROUNDS, SAMPLING, block_files, disk_engine, one_at_a_time
from test_remote_engine import (
    assert_b_loaded_from_remote,
    engine_settings,
    reference,
    run_engine_process,
)

from kvoffload.engine import EngineConfig


@pytest.fixture(scope="module")
def want() -> list:
    return reference_outputs([p for r in ROUNDS for p in r], SAMPLING)


@pytest.mark.parametrize("mode", ["lossless", "auto"])
def test_disk_lossless_outputs_are_identical(tmp_path: Path, want: list, mode: str) -> None:
    with disk_engine(tmp_path, kv_disk_compression=mode) as engine:
        outputs = [o for r in ROUNDS for o in one_at_a_time(engine, r)]
        stats = engine.stats()
    assert_same_outputs(outputs, want)
    assert stats["offload_tier_disk_loaded_blocks"] > 0
    assert stats["offload_tier_disk_failed_load_blocks"] == 0
    assert stats["offload_tier_disk_codec_encoded_blocks"] > 0
    assert stats["offload_tier_disk_codec_decoded_blocks"] > 0
    assert (
        stats["offload_tier_disk_codec_stored_bytes"] < stats["offload_tier_disk_codec_raw_bytes"]
    )


def test_damaged_compressed_files_are_recomputed(tmp_path: Path, want: list) -> None:
    with disk_engine(tmp_path, kv_disk_compression="lossless") as engine:
        one_at_a_time(engine, ROUNDS[0])
    files = block_files(tmp_path)
    assert files
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x10
        path.write_bytes(bytes(raw))
    with disk_engine(tmp_path, kv_disk_compression="lossless") as engine:
        outputs = one_at_a_time(engine, ROUNDS[1])
        stats = engine.stats()
    assert_same_outputs(outputs, want[8:16])
    assert stats["offload_tier_disk_failed_load_checksum"] > 0
    assert stats["offload_tier_promoted_blocks"] == 0


def test_a_full_disk_with_compression_keeps_serving(tmp_path: Path, want: list) -> None:
    def no_space(op: str, key: bytes) -> None:
        if op == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    with disk_engine(tmp_path, kv_disk_compression="lossless") as engine:
        engine.tiering.tiers[0]._files.fault_hook = no_space  # type: ignore[union-attr]
        outputs = [o for r in run_rounds(engine, ROUNDS, SAMPLING) for o in r]
        stats = engine.stats()
    assert_same_outputs(outputs, want)
    assert stats["offload_tier_disk_failed_store_full"] > 0
    assert stats["offload_tier_disk_stored_blocks"] == 0
    assert not block_files(tmp_path) and not list(tmp_path.rglob("*.tmp"))


def test_lossy_is_off_unless_configured(tmp_path: Path) -> None:
    config = EngineConfig()
    assert config.kv_disk_compression == "none" and config.kv_remote_compression == "none"
    with disk_engine(tmp_path / "exact") as engine:
        one_at_a_time(engine, ROUNDS[0][:2])
        stats = engine.stats()
    assert stats["offload_tier_disk_codec_encoded_blocks"] == 0
    with disk_engine(tmp_path / "exact", kv_disk_compression="fp8") as engine:
        lossy = engine.tiering.tiers[0]  # type: ignore[union-attr]
        assert lossy.stats()["used_blocks"] == 0  # the exact blocks are not its blocks
        one_at_a_time(engine, ROUNDS[0][:2])
        assert lossy.stats()["codec_encoded_blocks"] > 0


def _compressed(settings: dict[str, Any]) -> dict[str, Any]:
    return {**settings, "kv_remote_compression": "lossless"}


def test_remote_lossless_outputs_are_identical_across_processes(
    redis_server: RedisServer,
) -> None:
    rounds = ROUNDS[:2]
    settings = _compressed(engine_settings(redis_server.url))
    a = run_engine_process(settings, rounds)
    b = run_engine_process(settings, rounds)
    assert a["outputs"] == b["outputs"] == reference(rounds)
    assert a["stats"]["offload_tier_remote_codec_encoded_blocks"] > 0
    assert_b_loaded_from_remote(b)
    assert b["stats"]["offload_tier_remote_codec_decoded_blocks"] > 0


def test_remote_lossless_through_the_cluster(redis_cluster: RedisClusterServers) -> None:
    rounds = ROUNDS[:2]
    settings = _compressed(engine_settings(redis_cluster.url))
    a = run_engine_process(settings, rounds)
    b = run_engine_process(settings, rounds)
    assert a["outputs"] == b["outputs"] == reference(rounds)
    assert_b_loaded_from_remote(b)
    assert b["stats"]["offload_tier_remote_codec_decoded_blocks"] > 0
