"""A real ``redis-server`` on a free loopback port, started and stopped by its owner: what
``kvoffload bench throughput --instances 2`` runs when no ``--kv-remote-url`` is given, and the
base of the test fixtures and benchmarks; a Cluster of such servers (``tests/redis_servers.py``
adds TLS).

Debian's ``redis-server`` package provides the binary (``make setup`` installs it as root). When
it is missing, :func:`require_redis_binaries` raises :class:`RedisUnavailableError` whose message
says how to install it. Every wait is bounded in time: a server that does not come up is an error
carrying its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from kvoffload.errors import ContractError, KVOffloadError

__all__ = [
    "INSTALL_HINT",
    "RedisClusterServers",
    "RedisServer",
    "RedisUnavailableError",
    "cluster_servers",
    "free_port",
    "require_redis_binaries",
    "standalone_server",
    "wait_until",
]

INSTALL_HINT = (
    "redis-server and redis-cli are needed. Install them with `make setup` as root (it runs "
    "`apt-get install -y redis-server` on Debian/Ubuntu), or `sudo apt-get install -y "
    "redis-server`; without root, build Redis from source (`make` in a Redis release tarball) "
    "and put its src/ directory on PATH."
)

#: Seconds a server may take to accept connections.
START_TIMEOUT_S = 20.0


class RedisUnavailableError(KVOffloadError, RuntimeError):
    """``redis-server`` or ``redis-cli`` is not installed."""


def require_redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``; :class:`RedisUnavailableError` if missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RedisUnavailableError(INSTALL_HINT)
    return server, cli


def free_port(bus_offset: int | None = None) -> int:
    """A loopback port nobody listens on (and, with ``bus_offset``, port + offset free too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if bus_offset is None:
            return port
        if port + bus_offset < 65536:
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port + bus_offset))
                return port
    raise RuntimeError("no free loopback port found")


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05
) -> None:
    """Poll ``predicate`` until it is true; :class:`TimeoutError` naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@dataclass
class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``, no persistence, its files in
    ``workdir``. ``DEBUG`` is enabled for local clients (tests put a server to sleep)."""

    port: int
    workdir: Path
    password: str | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """``redis://`` URL of this server (with the password, if any)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client of this server (for checks and setup)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10, **kwargs
        )

    def start(self) -> None:
        """Start the process and wait until it answers ``PING`` (``extra_args`` come last, so
        they override the defaults)."""
        server, _ = require_redis_binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            server,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", "redis.log",
            "--enable-debug-command", "local",
            *(("--requirepass", self.password) if self.password else ()),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            wait_until(self._answers, START_TIMEOUT_S, f"redis-server on port {self.port}")
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}; log:\n{self.log_tail()}") from None

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"redis-server exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        log = self.workdir / "redis.log"
        return (
            "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""
        )

    def kill(self) -> None:
        """SIGKILL the process (a crash, as far as clients and a cluster can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block the process is stopped (SIGSTOP): the kernel still accepts its
        connections and takes what clients send, but nothing is ever answered (a server that
        hangs, however slow the machine). Resumed (SIGCONT) on exit."""
        if self.proc is None or self.proc.poll() is not None:
            raise ContractError("the server is not running: nothing to pause")
        pid = self.proc.pid
        self.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: _process_state(pid) in "Tt", START_TIMEOUT_S, "SIGSTOP", 0.005)
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc/PID/stat``: ``T`` when stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@contextlib.contextmanager
def standalone_server(
    *, password: str | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[RedisServer]:
    """A running standalone server, stopped and its files removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvo-redis-") as tmp:
        server = RedisServer(free_port(), Path(tmp), password=password, extra_args=extra_args)
        server.start()
        try:
            yield server
        finally:
            server.stop()


#: Seconds a cluster may take to agree on its state.
CLUSTER_TIMEOUT_S = 30.0


@dataclass
class RedisClusterServers:
    """A Redis Cluster of masters (with replicas, for tests), all on loopback."""

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
def cluster_servers(
    masters: int = 3, node_timeout_ms: int = 60_000, replicas: int = 1
) -> Iterator[RedisClusterServers]:
    """A running Cluster of ``masters`` masters and ``replicas`` replicas each (``redis-cli
    --cluster create ... --cluster-replicas N``), stopped and removed on exit.

    ``node_timeout_ms`` is ``cluster-node-timeout``: a killed master is failed over to its replica
    about twice that long after it stopped answering. The default is long, so that a master
    paused by a test (:meth:`RedisServer.paused`) is never failed over however slow the machine;
    failover tests pass a short one.
    """
    _, cli = require_redis_binaries()
    with tempfile.TemporaryDirectory(prefix="kvo-redis-cluster-") as tmp:
        nodes: list[RedisServer] = []
        cluster = RedisClusterServers(nodes)
        try:
            for _ in range((1 + replicas) * masters):
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
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=CLUSTER_TIMEOUT_S, env=_cli_env(),
            )  # fmt: skip
            cluster.wait_healthy(masters)
            wait_until(
                lambda: _replicas_in_sync(nodes, replicas * masters),
                CLUSTER_TIMEOUT_S,
                "replicas to sync",
                0.1,
            )
            yield cluster
        finally:
            cluster.close()


def _replicas_in_sync(nodes: list[RedisServer], replicas: int) -> bool:
    synced = 0
    for node in nodes:
        with contextlib.suppress(redis.RedisError), node.client() as c:
            info = c.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") == "up":
                synced += 1
    return synced == replicas


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("REDISCLI_AUTH", None)
    return env
