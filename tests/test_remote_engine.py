"""Engines sharing a remote tier: engine B, in another process, loads the prefixes engine A
computed from Redis (standalone and Cluster) and generates exactly what a run without offloading
generates; a Cluster master killed or put to sleep mid-run costs recomputation, never output."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_cases import (
    BLOCK_SIZE,
    cycling_rounds,
    host_gib,
    one_thread,  # noqa: F401  (autouse fixture)
    reference_outputs,
    tiny_engine,
)
from redis_servers import (
    RedisClusterServers,
    RedisServer,
    TLSRedisServer,
    cluster_servers,
    standalone_server,
)

from kvoffload.engine import SamplingParams
from kvoffload.errors import ConfigError

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 4
#: Seconds a remote lookup may take before its block counts as a miss, and a request may wait
#: for its promotions: generous, so that "B's first request loads A's prefix" never depends on
#: how fast the server answers (a busy test machine can take longer than the 0.25 s default).
GENEROUS_WAIT_S = 60.0


def engine_settings(url: str, **extra: Any) -> dict[str, Any]:
    """A tiny engine whose device cache holds fewer prefixes than a round uses, with a host tier
    and the remote tier at ``url``."""
    return {
        "block_size": BLOCK_SIZE,
        "num_device_blocks": 64,
        "kv_offloading_size": host_gib(256),
        "kv_remote_url": url,
        "kv_remote_lookup_wait_s": GENEROUS_WAIT_S,
        "kv_lookup_retry_s": GENEROUS_WAIT_S,
        "load_policy": "always",  # these tests are about what the tier serves
        **extra,
    }


def run_engine_process(settings: dict[str, Any], rounds: list[list[list[int]]]) -> dict[str, Any]:
    """Run one engine in a fresh Python process (``remote_engine_proc.py``)."""
    spec = json.dumps({"engine": settings, "rounds": rounds, "max_tokens": MAX_TOKENS})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "remote_engine_proc.py"), spec],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference(rounds: list[list[list[int]]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.output_token_ids for r in rounds for out in reference_outputs(r, params)]


def assert_b_loaded_from_remote(b: dict[str, Any]) -> None:
    stats = b["stats"]
    assert stats["offload_tier_remote_loaded_blocks"] > 0
    assert stats["offload_tier_promoted_blocks"] == stats["offload_tier_remote_loaded_blocks"]
    assert b["cached_offload"][0] > 0  # B's very first request loaded A's prefix


def run_a_then_b(url: str, rounds: list[list[list[int]]]) -> dict[str, Any]:
    """Engine A, then engine B, each in its own process on the remote tier at ``url``: both
    generate the outputs of a run without offloading, A stored blocks, B loaded them. Returns
    A's result."""
    settings = engine_settings(url)
    a = run_engine_process(settings, rounds)
    b = run_engine_process(settings, rounds)
    want = reference(rounds)
    assert a["outputs"] == want and b["outputs"] == want
    assert a["stats"]["offload_tier_remote_stored_blocks"] > 0
    assert_b_loaded_from_remote(b)
    return a


def test_second_process_loads_first_engines_prefixes(redis_server: RedisServer) -> None:
    with redis_server.client() as c:
        c.flushall()
    rounds = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=2, seed=31)
    a = run_a_then_b(redis_server.url, rounds)
    assert a["stats"]["offload_tier_remote_loaded_blocks"] == 0  # nobody had them before A


def test_second_process_through_the_cluster(redis_cluster: RedisClusterServers) -> None:
    for node in redis_cluster.masters():
        with node.client() as c:
            c.flushall()
    rounds = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=2, seed=32)
    settings = engine_settings(redis_cluster.url)
    a = run_engine_process(settings, rounds)
    counts = []
    for node in redis_cluster.masters():
        with node.client() as c:
            counts.append(sum(1 for _ in c.scan_iter(match=b"kvo:*", count=1000)))
    assert len(counts) == 3 and all(n > 0 for n in counts), counts
    assert sum(counts) == a["stats"]["offload_tier_remote_stored_blocks"]
    b = run_engine_process(settings, rounds)
    want = reference(rounds)
    assert a["outputs"] == want and b["outputs"] == want
    assert_b_loaded_from_remote(b)


def test_second_process_over_tls(tls_redis: TLSRedisServer) -> None:
    """rediss:// to a TLS-only redis-server (certificates made for the test), the CA given as
    ``ssl_ca_certs`` in the URL: engine B loads engine A's prefixes as over plain TCP."""
    rounds = cycling_rounds(num_prefixes=2, prefix_blocks=6, num_rounds=1, seed=34)
    run_a_then_b(tls_redis.url, rounds)


@pytest.mark.slow
def test_master_killed_or_stopped_mid_run_never_changes_output() -> None:
    rounds = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=4, seed=33)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = reference(rounds)
    with cluster_servers(masters=3, node_timeout_ms=1000) as cluster:
        settings = engine_settings(cluster.url)
        a = run_engine_process(settings, rounds[:1])
        assert a["outputs"] == want[:4]
        with tiny_engine(**{k: v for k, v in settings.items() if k != "block_size"}) as b:
            got = []
            for i, prompts in enumerate(rounds):
                if i == 2:  # one master killed: its replica takes over
                    cluster.masters()[0].kill()
                with contextlib.ExitStack() as stack:
                    if i == 1:  # one master stopped for the round: it never answers
                        stack.enter_context(cluster.masters()[1].paused())
                    got += [out.output_token_ids for out in b.generate(prompts, params)]
                    b.drain()
            stats = b.stats()
        assert got == want
        assert stats["offload_tier_remote_loaded_blocks"] > 0
        cluster.wait_healthy(3)  # the failover did happen and the cluster serves all slots


def test_remote_settings_are_checked_before_connecting() -> None:
    with pytest.raises(ConfigError, match="kv_remote_url"):
        tiny_engine(kv_offloading_size=host_gib(8), kv_remote_url="http://nope")
    with pytest.raises(ConfigError, match="kv_remote_url: a remote tier needs the host tier"):
        tiny_engine(kv_remote_url="redis://127.0.0.1:1")
    with pytest.raises(ConfigError, match="kv_remote_ttl_s"):
        tiny_engine(kv_offloading_size=host_gib(8), kv_remote_ttl_s=5.0)


def test_server_down_at_start_fails_or_degrades_with_optional(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without kv_remote_optional: one line saying to start the server or set it. With it: a
    warning that does not tell to set what is set (issue 21), and a run on the host tier."""
    from redis_servers import free_port

    url = f"redis://:hunter2-secret@127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigError, match="kv_remote_url: cannot reach") as info:
        tiny_engine(kv_offloading_size=host_gib(8), kv_remote_url=url)
    assert "hunter2-secret" not in str(info.value) and "set kv_remote_optional" in str(info.value)
    caplog.set_level(logging.WARNING)
    with tiny_engine(
        kv_offloading_size=host_gib(8), kv_remote_url=url, kv_remote_optional=True
    ) as engine:
        (warning,) = [r.getMessage() for r in caplog.records if "remote tier" in r.getMessage()]
        assert "cannot reach" in warning and "set kv_remote_optional" not in warning
        assert engine.tiering is None  # only the host tier
        out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].output_token_ids) == 2


def test_server_eviction_during_the_run_never_changes_output() -> None:
    """A server far too small for the blocks evicts while both engines run; B still generates
    exactly the reference outputs, recomputing what vanished."""
    rounds = cycling_rounds(num_prefixes=8, prefix_blocks=12, num_rounds=2, seed=34)
    with standalone_server(
        extra_args=("--maxmemory", "1200kb", "--maxmemory-policy", "allkeys-lru")
    ) as server:
        settings = engine_settings(server.url)
        a = run_engine_process(settings, rounds)
        b = run_engine_process(settings, rounds)
        with server.client() as c:
            evicted = c.info("stats")["evicted_keys"]
    want = reference(rounds)
    assert a["outputs"] == want and b["outputs"] == want
    assert evicted > 0
