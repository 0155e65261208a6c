"""The remote tier against a real Redis Cluster (3 masters, 1 replica each): blocks spread over
every shard, a shard that never answers, a master killed mid-run (the tier follows the
failover; no load ever returns wrong bytes), and a Cluster node addressed as a single server."""

from __future__ import annotations

import pytest
import torch
from redis.cluster import RedisCluster
from redis_servers import RedisClusterServers, cluster_servers
from remote_cases import (
    fill_random,
    job,
    keys_for,
    lookup_all,
    make_layout,
    make_pool,
    make_tier,
    run_job,
    wait_jobs,
    wait_until,
)

from kvoffload.errors import ConfigError
from kvoffload.manager_contract import LookupResult
from kvoffload.tiers.redis.tier import remote_key_prefix

N = 96


def shard_counts(cluster: RedisClusterServers, prefix: bytes) -> dict[int, int]:
    """Keys under ``prefix`` on each master (by port)."""
    counts = {}
    for node in cluster.masters():
        with node.client() as c:
            counts[node.port] = sum(1 for _ in c.scan_iter(match=prefix + b"*", count=1000))
    return counts


def test_blocks_spread_over_every_shard_and_load_elsewhere(
    redis_cluster: RedisClusterServers,
) -> None:
    layout = make_layout()
    (pool_a, view_a), (pool_b, view_b) = make_pool(N), make_pool(N)
    fill_random(pool_a, seed=11)
    a = make_tier(redis_cluster.url, view_a, layout)
    b = make_tier(redis_cluster.url, view_b, layout, stats_interval_s=0.05)
    try:
        keys = keys_for(N, salt=20)
        assert run_job(a, True, keys, list(range(N))).success
        counts = shard_counts(redis_cluster, remote_key_prefix(layout))
        assert len(counts) == 3 and all(n > 0 for n in counts.values())
        assert sum(counts.values()) == N
        assert lookup_all(b, keys) == [LookupResult.HIT] * N
        assert run_job(b, False, keys, list(range(N))).success
        assert torch.equal(pool_b, pool_a)
        wait_until(lambda: b.stats()["used_blocks"] >= N, "the server's key count")  # summed
        assert b.stats()["capacity_bytes"] > 0
    finally:
        a.close()
        b.close()


def test_a_shard_that_never_answers_fails_only_its_own_keys(
    redis_cluster: RedisClusterServers,
) -> None:
    """One master stopped (SIGSTOP; the session's Cluster has a node timeout far longer than the
    pause, so no failover starts): its keys fail ``timeout``, every other key loads exactly."""
    layout = make_layout()
    pool, view = make_pool(N)
    fill_random(pool, seed=12)
    reference = pool.clone()
    tier = make_tier(redis_cluster.url, view, layout, timeout_s=0.3, stats_interval_s=3600)
    try:
        keys = keys_for(N, salt=21)
        assert run_job(tier, True, keys, list(range(N))).success
        slow = redis_cluster.masters()[0]
        prefix = remote_key_prefix(layout)
        with RedisCluster(host="127.0.0.1", port=slow.port) as oracle:
            on_slow = {k for k in keys if oracle.get_node_from_key(prefix + k).port == slow.port}
        assert 0 < len(on_slow) < N
        pool.zero_()
        with slow.paused():
            result = run_job(tier, False, keys, list(range(N)))
        assert set(result.failed_keys) == on_slow  # one timeout, that shard's keys only
        assert set(result.failed_keys.values()) == {"timeout"}
        ok = [i for i, k in enumerate(keys) if k not in on_slow]
        assert torch.equal(pool[ok], reference[ok])
    finally:
        tier.close()
    redis_cluster.wait_healthy(3)


def test_a_cluster_node_addressed_as_one_server_is_one_line(
    redis_cluster: RedisClusterServers,
) -> None:
    """Before: it started, and every store of a key another node serves was dropped (MOVED)
    without a word."""
    node = redis_cluster.masters()[0]
    _, view = make_pool(2)
    with pytest.raises(ConfigError) as info:
        make_tier(f"redis://127.0.0.1:{node.port}/0", view, make_layout())
    message = str(info.value)
    assert message.startswith(f"kv_remote_url: redis://127.0.0.1:{node.port}/0 is a Redis Cluster")
    assert f"use redis+cluster://127.0.0.1:{node.port}" in message and "\n" not in message


def _replicas_caught_up(cluster: RedisClusterServers) -> bool:
    for node in cluster.masters():
        with node.client() as c:
            info = c.info("replication")
            offset = info["master_repl_offset"]
            replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if not replicas or any(r["offset"] < offset for r in replicas):
                return False
    return True


def test_master_killed_mid_run_is_followed_to_its_replica() -> None:
    layout = make_layout()
    with cluster_servers(masters=3, node_timeout_ms=1000) as cluster:
        (pool_a, view_a), (pool_b, view_b) = make_pool(N), make_pool(N)
        fill_random(pool_a, seed=13)
        a = make_tier(cluster.url, view_a, layout, timeout_s=0.5)
        b = make_tier(cluster.url, view_b, layout, timeout_s=0.5, miss_ttl_s=0.1)
        try:
            keys = keys_for(N, salt=22)
            assert run_job(a, True, keys, list(range(N))).success
            wait_until(lambda: _replicas_caught_up(cluster), "replication of the stored blocks")
            victim = cluster.masters()[0]
            victim.kill()

            # Mid-failover: loads may fail (recomputed) but never return wrong bytes.
            half = N // 2
            b.submit_load(job(keys[:half], list(range(half))))
            a.submit_store(job(keys_for(8, salt=23), list(range(8))))
            (during,) = wait_jobs(b, 1)
            wait_jobs(a, 1)
            ok = [i for i, k in enumerate(keys[:half]) if k not in during.failed_keys]
            assert torch.equal(pool_b[ok], pool_a[ok])
            assert set(during.failed_keys.values()) <= {"io", "timeout", "missing"}

            cluster.wait_healthy(3)  # the replica took over the slots

            def loads_all() -> bool:
                pool_b.zero_()
                if lookup_all(b, keys) != [LookupResult.HIT] * N:
                    return False
                return run_job(b, False, keys, list(range(N))).success

            wait_until(loads_all, "loads through the promoted replica")
            assert torch.equal(pool_b, pool_a)
            fresh = keys_for(8, salt=24)

            def stores_again() -> bool:
                return run_job(a, True, fresh, list(range(8))).success

            wait_until(stores_again, "stores after the failover")
            counts = shard_counts(cluster, remote_key_prefix(layout))
            assert len(counts) == 3 and victim.port not in counts
        finally:
            a.close()
            b.close()
