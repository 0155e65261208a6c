"""drop_namespace against real servers: only the namespace's keys go, standalone and on every
Cluster master; a bench run's fresh namespace is removed after it, and a server that cannot be
reached then is a warning that shows no password."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
from redis.cluster import RedisCluster

from kvoffload.benchmark.interleave import fresh_remote_namespace
from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.admin import drop_namespace


def _fill(client: Any, namespaces: dict[bytes, int]) -> None:
    for prefix, n in namespaces.items():
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            pipe.set(prefix + b"%d" % i, b"v")
        pipe.execute()


def test_only_the_namespace_is_dropped(redis_server: Any) -> None:
    """2,500 keys (several SCAN pages and UNLINK batches) go; another namespace, the keys of
    ``kvo:`` itself and keys that are not ours stay."""
    with redis_server.client() as c:
        c.flushall()
        _fill(c, {b"kvo:ns1:fp:": 2500, b"kvo:ns12:fp:": 7, b"kvo:fp:": 5, b"ns1:": 3})
        assert drop_namespace(redis_server.url + "?namespace=ns1") == 2500
        left = sorted(c.keys("*"))
        assert len(left) == 15 and not any(k.startswith(b"kvo:ns1:") for k in left)
        assert drop_namespace(redis_server.url + "?namespace=ns1") == 0
        c.flushall()


def test_every_cluster_master_is_swept(redis_cluster: Any) -> None:
    seed = redis_cluster.masters()[0]
    with RedisCluster(host="127.0.0.1", port=seed.port, socket_timeout=10) as c:
        _fill(c, {b"kvo:gone:fp:": 300, b"kvo:kept:fp:": 30})
        per_master = []
        for node in redis_cluster.masters():
            with node.client() as nc:
                per_master.append(sum(1 for _ in nc.scan_iter(match=b"kvo:gone:*")))
        assert len(per_master) == 3 and all(n > 0 for n in per_master)
        assert drop_namespace(redis_cluster.url + "?namespace=gone") == 300
        for node in redis_cluster.masters():
            with node.client() as nc:
                assert not list(nc.scan_iter(match=b"kvo:gone:*"))
        assert drop_namespace(redis_cluster.url + "?namespace=kept") == 30


def test_a_url_without_namespace_is_refused(redis_server: Any) -> None:
    with pytest.raises(ConfigError, match=r"\?namespace="):
        drop_namespace(redis_server.url)


def test_a_bench_namespace_is_removed_after_its_run(redis_server: Any) -> None:
    with redis_server.client() as c:
        c.flushall()
        c.set(b"kvo:fp:0", b"v")
        with fresh_remote_namespace({"kv_remote_url": redis_server.url}, True) as kwargs:
            space = kwargs["kv_remote_url"].rsplit("namespace=", 1)[1]
            _fill(c, {b"kvo:" + space.encode() + b":fp:": 10})
        assert c.keys("*") == [b"kvo:fp:0"]
        c.flushall()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_warning_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://:s3cret-pw@127.0.0.1:{_dead_port()}/0"
    with (
        caplog.at_level(logging.WARNING),
        fresh_remote_namespace({"kv_remote_url": url}, True) as kwargs,
    ):
        assert "namespace=bench-" in kwargs["kv_remote_url"]
    assert "could not remove the run's namespace" in caplog.text
    assert "s3cret-pw" not in caplog.text and "***" in caplog.text
