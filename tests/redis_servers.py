"""Real ``redis-server`` processes for tests and benchmarks: one standalone server
(:mod:`kvoffload.benchmark.redis_server`, which ``bench throughput --instances 2`` uses too), or a
Cluster of masters with one replica each, on free loopback ports, stopped (and their files
removed) on :meth:`close`.

Nothing here is a fake: the processes are Debian's ``redis-server`` (``make setup`` installs it as
root). When the binaries are missing, :func:`require_redis_binaries` raises
:class:`RedisUnavailableError` whose message says how to install them; the test fixtures turn it
into a test failure, never a skip.

Every wait loop is bounded in time (a server that does not come up is an error with its log).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from kvoffload.benchmark.redis_server import (
    INSTALL_HINT,
    RedisServer,
    RedisUnavailableError,
    free_port,
    require_redis_binaries,
    standalone_server,
    wait_until,
)

__all__ = [
    "INSTALL_HINT",
    "RedisClusterServers",
    "RedisServer",
    "RedisUnavailableError",
    "cluster_servers",
    "free_port",
    "require_redis_binaries",
    "standalone_server",
]

#: Seconds a cluster may take to agree on its state.
CLUSTER_TIMEOUT_S = 30.0


@dataclass
class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters with one replica each, all on loopback."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL naming every node as a seed."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def node_client(self, node: RedisServer) -> redis.Redis:
        return node.client()

    def masters(self) -> list[RedisServer]:
        """Nodes that are masters now (failover changes which)."""
        out = []
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with contextlib.suppress(redis.RedisError), node.client() as c:
                if c.info("replication")["role"] == "master":
                    out.append(node)
        return out

    def wait_healthy(self, num_masters: int, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and ``num_masters`` masters
        hold slots."""

        def healthy() -> bool:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            try:
                for node in live:
                    with node.client() as c:
                        if c.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                            return False
            except redis.RedisError:
                return False
            return len(self.masters()) == num_masters

        wait_until(healthy, timeout_s, "the cluster to report cluster_state:ok", 0.1)

    def close(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def cluster_servers(masters: int = 3, node_timeout_ms: int = 1000) -> Iterator[RedisClusterServers]:
    """A running Cluster of ``masters`` masters and one replica each (``redis-cli --cluster
    create ... --cluster-replicas 1``), stopped and removed on exit.

    ``node_timeout_ms`` is ``cluster-node-timeout``: a killed master is failed over to its replica
    about twice that long after it stopped answering.
    """
    _, cli = require_redis_binaries()
    with tempfile.TemporaryDirectory(prefix="kvo-redis-cluster-") as tmp:
        nodes: list[RedisServer] = []
        cluster = RedisClusterServers(nodes)
        try:
            for _ in range(2 * masters):
                port = free_port(bus_offset=10000)
                node = RedisServer(
                    port,
                    Path(tmp) / str(port),
                    extra_args=(
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(node_timeout_ms),
                        "--cluster-replica-validity-factor", "0",
                    ),
                )  # fmt: skip
                node.start()
                nodes.append(node)
            subprocess.run(
                [cli, "--cluster", "create", *(n.address for n in nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=CLUSTER_TIMEOUT_S, env=_cli_env(),
            )  # fmt: skip
            cluster.wait_healthy(masters)
            wait_until(
                lambda: _replicas_in_sync(nodes, masters),
                CLUSTER_TIMEOUT_S,
                "replicas to sync",
                0.1,
            )
            yield cluster
        finally:
            cluster.close()


def _replicas_in_sync(nodes: list[RedisServer], masters: int) -> bool:
    synced = 0
    for node in nodes:
        with contextlib.suppress(redis.RedisError), node.client() as c:
            info = c.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") == "up":
                synced += 1
    return synced == masters


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("REDISCLI_AUTH", None)
    return env
