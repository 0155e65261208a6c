"""The listening address of ``serve`` and ``route``, bound before anything slow starts: a port
already in use is one line naming it and exit status 2 at once, not after the model has loaded
(as vLLM binds its socket before its engine starts)."""

from __future__ import annotations

import errno
import socket

from kvoffload.errors import ConfigError

__all__ = ["bind_listener"]


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening; uvicorn listens on it), with
    ``SO_REUSEADDR`` as uvicorn's own. :class:`ConfigError` naming ``port`` when it is in use,
    ``host`` when it is not an address of this machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError("port", f"{shown} is already in use") from None
        if exc.errno == errno.EACCES:
            raise ConfigError("port", f"{shown}: permission denied (ports below 1024 need "
                              "privileges)") from None
        raise ConfigError("host", f"cannot listen on {shown}: {exc.strerror or exc}") from None
    return sock
