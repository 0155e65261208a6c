"""Real ``redis-server`` processes for tests: a standalone server or a Cluster of masters with
one replica each (:mod:`kvoffload.benchmark.redis_server`, which ``bench throughput --instances
2`` and the benchmarks use too), and a TLS-only server with certificates made for it, on free
loopback ports, stopped (and their files removed) on exit.

Nothing here is a fake: the processes are Debian's ``redis-server`` (``make setup`` installs it as
root). When the binaries are missing, :func:`require_redis_binaries` raises
:class:`RedisUnavailableError` whose message says how to install them; the test fixtures turn it
into a test failure, never a skip.

Every wait loop is bounded in time (a server that does not come up is an error with its log).
"""

from __future__ import annotations

import contextlib
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
    RedisClusterServers,
    RedisServer,
    RedisUnavailableError,
    cluster_servers,
    free_port,
    require_redis_binaries,
    standalone_server,
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
    commands: list[list[str | Path]] = [
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
