"""A real ``redis-server`` on a free loopback port, started and stopped by its owner: what
``kvoffload bench throughput --instances 2`` runs when no ``--kv-remote-url`` is given, and the
base of the test fixtures (``tests/redis_servers.py`` adds the Cluster).

Debian's ``redis-server`` package provides the binary (``make setup`` installs it as root). When
it is missing, :func:`require_redis_binaries` raises :class:`RedisUnavailableError` whose message
says how to install it. Every wait is bounded in time: a server that does not come up is an error
carrying its log.
"""

from __future__ import annotations

import contextlib
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

__all__ = [
    "INSTALL_HINT",
    "RedisServer",
    "RedisUnavailableError",
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


class RedisUnavailableError(RuntimeError):
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
