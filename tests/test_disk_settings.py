"""The disk tier's settings say what is wrong (issue 21): a size beyond what the filesystem
holds, a path under a regular file; a size beyond the free space is a warning."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from tier_cases import host_pool, layout, small_tmpfs

from kvoffload.engine import EngineConfig
from kvoffload.errors import ConfigError
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier
from kvoffload.tiers.factory import validate_disk_settings

GIB = 2**30


def filesystem_gib(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize / GIB


@pytest.mark.parametrize("size", [1e300, 1e30])
def test_a_size_beyond_the_whole_filesystem_is_refused_with_its_size(
    tmp_path: Path, size: float
) -> None:
    """1e300 GiB ended in ``OverflowError`` when the tier was built (from the CLI and from
    ``Engine``), 1e30 was accepted silently; both are more than any filesystem holds."""
    total = filesystem_gib(tmp_path)
    for check in (
        lambda: validate_disk_settings(tmp_path / "kv", size),
        lambda: EngineConfig(
            kv_offloading_size=0.01, kv_disk_path=str(tmp_path), kv_disk_size=size
        ),
    ):
        with pytest.raises(ConfigError, match="kv_disk_size") as caught:
            check()
        message = str(caught.value)
        assert "more than the filesystem" in message and f"{total:.4g} GiB in all" in message
        assert "GiB free" in message


def test_a_size_within_the_filesystem_is_accepted(tmp_path: Path) -> None:
    validate_disk_settings(tmp_path / "kv", min(1.0, filesystem_gib(tmp_path) / 2))


def test_a_size_beyond_the_free_space_warns_once_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 512 KiB tmpfs with 384 KiB taken by another file: a 448 KiB bound fits the filesystem
    but not its free space: accepted, with one warning naming both (skips unless root)."""
    with small_tmpfs(tmp_path / "small", "512k") as mount:
        (mount / "other.bin").write_bytes(bytes(384 * 1024))
        size_gib = 448 * 1024 / GIB
        validate_disk_settings(mount / "kv", size_gib)
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            tier = DiskTier(host_pool(2), layout(), DiskTierSettings(mount / "kv", 448 * 1024))
            tier.close()
        (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert line.startswith("kv_disk_size: ") and "more than the filesystem" in line
        assert "GiB free" in line


def test_a_path_under_a_regular_file_says_so(tmp_path: Path) -> None:
    """It said "is not writable"."""
    file = tmp_path / "notes.txt"
    file.write_text("x")
    under = file / "kv"
    want = f"{str(under)!r} cannot be created: {str(file)!r} is a file, not a directory"
    for check in (
        lambda: validate_disk_settings(under, 1.0),
        lambda: EngineConfig(kv_offloading_size=0.01, kv_disk_path=str(under), kv_disk_size=1.0),
        lambda: DiskTier(host_pool(2), layout(), DiskTierSettings(under, 1 << 20)),
    ):
        with pytest.raises(ConfigError, match="kv_disk_path") as caught:
            check()
        assert want in str(caught.value)
