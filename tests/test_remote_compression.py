"""The remote tier with compression against real ``redis-server`` processes (standalone and a
Cluster): lossless loads give back the exact bytes and store fewer, every mix of raw and lossless
tiers on one server serves exact blocks, damaged frames fail their loads and are deleted, a tight
``maxmemory`` holds more compressed blocks, and lossy (fp8) blocks never meet exact ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from redis_servers import RedisServer, standalone_server
from remote_cases import keys_for, lookup_all, make_pool, make_tier, run_job, wait_until
from remote_codec_cases import fill_kv, kv_layout

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult
from kvoffload.tiers.blockformat import encode_header, payload_checksum
from kvoffload.tiers.codec.frame import LOSSLESS_ID, pack_frame_header
from kvoffload.tiers.redis.tier import VALUE_ALIGN, remote_key_prefix

HIT, MISS = LookupResult.HIT, LookupResult.MISS
BLOCK = 16 * 1024


def _value_lengths(client: Any, prefix: bytes, keys: list[OffloadKey]) -> list[int]:
    with client() as c:
        return [c.strlen(prefix + key) for key in keys]


@pytest.mark.parametrize(
    "writer,reader",
    [("lossless", "lossless"), ("lossless", "none"), ("none", "lossless"), ("auto", "none")],
)
def test_loads_are_exact_whatever_each_tier_compresses(
    redis_server: RedisServer, writer: str, reader: str
) -> None:
    layout = kv_layout(BLOCK)
    (pool_a, view_a), (pool_b, view_b) = make_pool(8, BLOCK), make_pool(8, BLOCK)
    fill_kv(pool_a, seed=1)
    a = make_tier(redis_server.url, view_a, layout, compression=writer)
    b = make_tier(redis_server.url, view_b, layout, compression=reader)
    try:
        keys = keys_for(8, salt=101)
        assert run_job(a, True, keys, list(range(8))).success
        assert lookup_all(b, keys) == [HIT] * 8
        assert run_job(b, False, keys, list(range(8))).success
        assert torch.equal(pool_b, pool_a)
        lengths = _value_lengths(redis_server.client, remote_key_prefix(layout), keys)
        if writer == "none":
            assert min(lengths) > BLOCK
        else:
            stats = a.stats()
            assert (
                stats["codec_encoded_blocks"] >= 1
                and stats["codec_raw_bytes"] > 1.2 * stats["codec_stored_bytes"]
            )
            assert min(lengths) < BLOCK / 1.2  # what the server holds is the compressed value
        if reader != "none" or writer != "none":
            assert b.stats()["codec_decoded_blocks"] == sum(n < BLOCK for n in lengths)
    finally:
        a.close()
        b.close()


def test_cluster_round_trip_is_exact_and_compressed(redis_cluster: Any) -> None:
    layout = kv_layout(BLOCK)
    (pool_a, view_a), (pool_b, view_b) = make_pool(32, BLOCK), make_pool(32, BLOCK)
    fill_kv(pool_a, seed=2)
    a = make_tier(redis_cluster.url, view_a, layout, compression="lossless")
    b = make_tier(redis_cluster.url, view_b, layout, compression="lossless")
    try:
        keys = keys_for(32, salt=102)
        assert run_job(a, True, keys, list(range(32))).success
        assert lookup_all(b, keys) == [HIT] * 32
        assert run_job(b, False, keys, list(range(32))).success
        assert torch.equal(pool_b, pool_a)
        assert b.stats()["codec_decoded_blocks"] == 32
    finally:
        a.close()
        b.close()


def test_damaged_frames_fail_their_loads_and_are_deleted(redis_server: RedisServer) -> None:
    """A flipped byte fails the checksum; a frame with a valid checksum that does not decode
    (written by a buggy peer) fails ``corrupt``; both are deleted, the others load exactly."""
    layout = kv_layout(BLOCK)
    (pool_a, view_a), (pool_b, view_b) = make_pool(4, BLOCK), make_pool(4, BLOCK)
    fill_kv(pool_a, seed=3)
    a = make_tier(redis_server.url, view_a, layout, compression="lossless")
    b = make_tier(redis_server.url, view_b, layout, compression="lossless")
    try:
        keys = keys_for(4, salt=103)
        assert run_job(a, True, keys, [0, 1, 2, 3]).success
        prefix = remote_key_prefix(layout)
        with redis_server.client() as c:
            value = bytearray(c.get(prefix + keys[0]))
            value[-100] ^= 0x01
            c.set(prefix + keys[0], bytes(value))
            frame = pack_frame_header(LOSSLESS_ID, 2, BLOCK) + bytes(64)  # plane table lies
            head = encode_header(
                layout.fingerprint(),
                keys[2],
                len(frame),
                payload_checksum(frame),
                VALUE_ALIGN,
                encoded=True,
            )
            c.set(prefix + keys[2], head + frame)
        pool_b.fill_(0xEE)
        result = run_job(b, False, keys, [0, 1, 2, 3])
        assert result.failed_keys == {keys[0]: "checksum", keys[2]: "corrupt"}
        assert torch.equal(pool_b[1], pool_a[1]) and torch.equal(pool_b[3], pool_a[3])
        assert bool((pool_b[0] == 0xEE).all())  # a bad frame is never decoded into its slot
        with redis_server.client() as c:
            assert not c.exists(prefix + keys[0]) and not c.exists(prefix + keys[2])
    finally:
        a.close()
        b.close()


def test_a_tight_maxmemory_holds_more_compressed_blocks() -> None:
    """The server's bound counts what is stored: the same ``maxmemory`` keeps more blocks
    compressed than raw; evicted blocks are misses, the rest load exactly."""
    block = 64 * 1024
    kept = {}
    for mode in ("none", "lossless"):
        with standalone_server(
            extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
        ) as server:
            tensor, view = make_pool(96, block)
            fill_kv(tensor, seed=4)
            layout = kv_layout(block)
            tier = make_tier(server.url, view, layout, compression=mode)
            try:
                keys = keys_for(96, salt=104)
                for start in range(0, 96, 8):  # 6 MiB raw into a 4 MiB server
                    run_job(tier, True, keys[start : start + 8], list(range(start, start + 8)))
                before = tensor.clone()
                tensor.zero_()
                result = run_job(tier, False, keys, list(range(96)))
                assert set(result.failed_keys.values()) <= {"missing"}
                present = [i for i, key in enumerate(keys) if key not in result.failed_keys]
                assert torch.equal(tensor[present], before[present])
                kept[mode] = len(present)
            finally:
                tier.close()
    assert kept["lossless"] > kept["none"] * 1.15, kept


def test_a_full_server_refuses_compressed_stores() -> None:
    block = 64 * 1024
    with standalone_server(
        extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    ) as server:
        tensor, view = make_pool(96, block)
        fill_kv(tensor, seed=5)
        tier = make_tier(server.url, view, kv_layout(block), compression="lossless")
        try:
            result = run_job(tier, True, keys_for(96, salt=105), list(range(96)))
            assert "full" in result.failed_keys.values()
            assert tier.stats()["failed_store_full"] == len(result.failed_keys)
        finally:
            tier.close()


def test_lossy_blocks_never_meet_exact_ones(redis_server: RedisServer) -> None:
    """fp8 blocks live under their own keys: an exact tier never finds them, an fp8 tier never
    finds exact ones; an fp8 load is within e4m3's error and reported as such."""
    layout = kv_layout(BLOCK)
    (pool_a, view_a), (_pool_b, view_b) = make_pool(4, BLOCK), make_pool(4, BLOCK)
    fill_kv(pool_a, seed=6)
    lossy = make_tier(redis_server.url, view_a, layout, compression="fp8")
    exact = make_tier(redis_server.url, view_b, layout, compression="lossless")
    try:
        lossy_keys, exact_keys = keys_for(2, salt=106), keys_for(2, salt=107)
        assert run_job(lossy, True, lossy_keys, [0, 1]).success
        assert run_job(exact, True, exact_keys, [0, 1]).success
        assert lookup_all(exact, lossy_keys) == [MISS, MISS]
        assert lookup_all(lossy, exact_keys) == [MISS, MISS]
        with redis_server.client() as c:
            assert not c.exists(remote_key_prefix(layout) + lossy_keys[0])
        assert run_job(lossy, False, lossy_keys, [2, 3]).success
        want = pool_a[:2].view(torch.bfloat16).float()
        got = pool_a[2:].view(torch.bfloat16).float()
        assert not torch.equal(got, want)
        assert bool(((got - want).abs() <= want.abs() / 16 + want.abs() / 128 + 1e-3).all())
        stats = lossy.stats()
        assert (
            1.9 <= stats["codec_raw_bytes"] / stats["codec_stored_bytes"] <= 2.0
        )  # 128 / (64 + 2)
    finally:
        lossy.close()
        exact.close()


def test_compression_setting_is_checked(redis_server: RedisServer) -> None:
    _tensor, view = make_pool(2, BLOCK)
    with pytest.raises(ConfigError, match="kv_remote_compression"):
        make_tier(redis_server.url, view, kv_layout(BLOCK), compression="gzip")
    with pytest.raises(ConfigError, match="kv_remote_compression"):
        make_tier(redis_server.url, view, kv_layout(BLOCK, "torch.int8"), compression="fp8")


def test_compression_is_off_unless_configured(redis_server: RedisServer) -> None:
    tensor, view = make_pool(2, BLOCK)
    fill_kv(tensor, seed=7)
    tier = make_tier(redis_server.url, view, kv_layout(BLOCK))
    try:
        assert tier.config.compression == "none"
        keys = keys_for(2, salt=108)
        assert run_job(tier, True, keys, [0, 1]).success
        assert tier.stats()["codec_encoded_blocks"] == 0
        assert min(_value_lengths(redis_server.client, tier._blocks.prefix, keys)) > BLOCK
    finally:
        tier.close()


def test_auto_compresses_once_the_server_evicts() -> None:
    """``auto`` on a tight ``maxmemory``: once the server evicts, room is what is short, and
    every block the codec shrinks by 1.1x or more is stored compressed (whatever the link)."""
    block = 64 * 1024
    with standalone_server(
        extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    ) as server:
        tensor, view = make_pool(96, block)
        fill_kv(tensor, seed=9)
        tier = make_tier(
            server.url, view, kv_layout(block), compression="auto", stats_interval_s=0.05
        )
        try:
            keys = keys_for(96, salt=109)
            for start in range(0, 80, 8):  # 5 MiB raw into a 4 MiB server
                run_job(tier, True, keys[start : start + 8], list(range(start, start + 8)))
            wait_until(lambda: tier._blocks.codec._auto.capacity_bound, "auto seeing the evictions")
            before = tier.stats()["codec_encoded_blocks"]
            assert run_job(tier, True, keys[80:88], list(range(80, 88))).success
            assert tier.stats()["codec_encoded_blocks"] == before + 8
        finally:
            tier.close()
