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
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

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
    "TLSRedisServer",
    "cluster_servers",
    "free_port",
    "make_certificates",
    "require_redis_binaries",
    "standalone_server",
    "tls_server",
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


TLS_HINT = (
    "this redis-server cannot serve TLS (it was built without it). Debian's and Ubuntu's "
    "redis-server packages (6.0 and later) have TLS: `sudo apt-get install -y redis-server`; "
    "from source, build with `make BUILD_TLS=yes` and put its src/ directory on PATH"
)
OPENSSL_HINT = (
    "the TLS test generates its certificates with the openssl command-line tool: install it "
    "with `sudo apt-get install -y openssl` (Debian/Ubuntu) or your system's package manager"
)


def make_certificates(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A fresh CA and a server certificate it signed, for ``127.0.0.1`` and ``localhost``, made
    with the ``openssl`` CLI in ``directory``: ``(ca.pem, server.pem, server.key)`` named by
    ``name``. Valid one day; the extensions Python's strict X.509 checks want are set."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisUnavailableError(OPENSSL_HINT)
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
    cert, key = directory / f"{name}-server.pem", directory / f"{name}-server.key"
    csr, ext = directory / f"{name}-server.csr", directory / f"{name}-server.ext"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    commands = [
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
         "-subj", f"/CN=kvoffload test CA {name}",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", ext],
    ]  # fmt: skip
    for command in commands:
        subprocess.run(command, check=True, capture_output=True, timeout=60)
    return ca, cert, key


@dataclass
class TLSRedisServer(RedisServer):
    """A server that speaks TLS only (``--port 0 --tls-port``); clients need ``ca``."""

    ca: Path | None = None

    @property
    def url(self) -> str:
        """``rediss://`` URL of this server, with ``ssl_ca_certs`` naming its CA."""
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.ca))}"

    def client(self, **kwargs: Any) -> redis.Redis:
        return super().client(ssl=True, ssl_ca_certs=str(self.ca), **kwargs)


@contextlib.contextmanager
def tls_server() -> Iterator[TLSRedisServer]:
    """A running TLS-only standalone server with certificates made for it (a CA of its own;
    clients are not asked for certificates), stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvo-redis-tls-") as tmp:
        ca, cert, key = make_certificates(Path(tmp) / "certs", "test")
        port = free_port()
        server = TLSRedisServer(
            port,
            Path(tmp) / "data",
            extra_args=(
                "--port", "0",
                "--tls-port", str(port),
                "--tls-cert-file", str(cert),
                "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(ca),
                "--tls-auth-clients", "no",
            ),
            ca=ca,
        )  # fmt: skip
        try:
            server.start()
        except RuntimeError as exc:  # the process exited: a build without TLS says so in its log
            if "tls" in str(exc).lower():
                raise RedisUnavailableError(f"{TLS_HINT}\n{exc}") from None
            raise
        try:
            yield server
        finally:
            server.stop()
