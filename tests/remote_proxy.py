"""A TCP proxy of ours on loopback, in front of a real server, that shapes what the client
receives: the server's bytes trickle to the client in small segments with pauses between (so a
reply arrives in many TCP segments and every ``recv`` returns a piece), and the connection can be
dropped after a chosen number of bytes (mid-value), and the server's replies can be held until
the test releases them (a server that answers late, without timing), all of them or only those
of connections opened from a chosen moment on (a new client held, the older ones flowing). What
the client sends passes unchanged.

Bounded: every socket has a timeout, the threads are daemons, :meth:`TrickleProxy.close` stops
them all.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

__all__ = ["TrickleProxy"]

_TIMEOUT_S = 30.0


class TrickleProxy:
    """Proxy ``127.0.0.1:port`` → ``127.0.0.1:target_port`` (module docstring).

    ``segment``: forward the server's bytes in pieces of 1..``segment`` bytes (random), pausing
    ``pause_s`` after each; ``None`` forwards them as they come. :meth:`drop_after` arms a
    one-shot cut: once that many more bytes went to clients, the connection that would forward
    the next byte is closed on both sides.
    """

    def __init__(self, target_port: int, segment: int | None = None, pause_s: float = 0.0005):
        self.target_port = target_port
        self.segment = segment
        self.pause_s = pause_s
        self._cut_left: int | None = None
        self._released = threading.Event()
        self._released.set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._rng = random.Random(0)
        self.connections = 0
        self._new_gate: threading.Event | None = None
        #: set when a connection is accepted while :meth:`hold_new` holds new ones
        self.held_connection = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="trickle-accept").start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def drop_after(self, num_bytes: int) -> None:
        """Cut the connection that would forward a byte past the next ``num_bytes`` (once)."""
        with self._lock:
            self._cut_left = num_bytes

    def hold(self) -> None:
        """Hold every reply from now on (the server's bytes wait in the proxy) until
        :meth:`release`."""
        self._released.clear()

    def release(self) -> None:
        """Forward the held replies and every later one."""
        self._released.set()

    def hold_new(self) -> None:
        """Hold the replies on connections accepted from now on (older ones flow) until
        :meth:`release_new`; :attr:`held_connection` is set when one is accepted."""
        with self._lock:
            self._new_gate = threading.Event()
        self.held_connection.clear()

    def release_new(self) -> None:
        """Forward what :meth:`hold_new` held; later connections flow."""
        with self._lock:
            gate, self._new_gate = self._new_gate, None
        if gate is not None:
            gate.set()

    def close(self) -> None:
        self._closed.set()
        self._released.set()
        self.release_new()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _close(sock)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port), _TIMEOUT_S)
            for sock in (client, upstream):
                sock.settimeout(_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
                self.connections += 1
                gate = self._new_gate
            if gate is not None:
                self.held_connection.set()
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True, gate),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_client: bool,
              gate: threading.Event | None = None) -> None:
        try:
            while not self._closed.is_set():
                data = source.recv(1 << 16)
                if not data:
                    break
                if not to_client:
                    sink.sendall(data)
                    continue
                self._released.wait(_TIMEOUT_S)
                if gate is not None:
                    gate.wait(_TIMEOUT_S)
                view = memoryview(data)
                while view:
                    piece = self._next_piece(len(view))
                    if piece == 0:  # the armed cut: drop both sides mid-stream
                        _close(source)
                        _close(sink)
                        return
                    sink.sendall(view[:piece])
                    view = view[piece:]
                    if self.segment is not None:
                        time.sleep(self.pause_s)
        except OSError:
            pass
        finally:
            _close(source)
            _close(sink)

    def _next_piece(self, available: int) -> int:
        """Bytes to forward next (0: cut now)."""
        piece = available if self.segment is None else self._rng.randint(1, self.segment)
        piece = min(piece, available)
        with self._lock:
            left = self._cut_left
            if left is not None:
                if left == 0:
                    self._cut_left = None
                    return 0
                piece = min(piece, left)
                self._cut_left = left - piece
        return piece


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
