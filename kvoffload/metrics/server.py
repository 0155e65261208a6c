"""``/metrics`` over HTTP for one registry, stopped with its engine."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from kvoffload.errors import ConfigError

__all__ = ["MetricsServer"]


class MetricsServer:
    """Serves ``registry`` at ``http://host:port/metrics`` on a daemon thread.

    ``port=0`` picks a free port (see :attr:`port`). A port that cannot be bound raises
    :class:`ConfigError` naming ``metrics_port``. :meth:`close` stops serving and frees the port.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ConfigError(
                "metrics_port", f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        self._server: WSGIServer | None = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        self._thread.join(timeout=5)
