"""One connection to one Redis / Valkey server: RESP2 over plain TCP or TLS, values received
straight into the caller's buffers. The wire level of the remote tier's transport.

Sending: a pipeline goes out with ``sendmsg`` as a list of buffers, so a stored value's header
and the host slot's ``memoryview`` reach the socket without being joined (TLS sockets have no
``sendmsg``: the buffers are sent one by one).

Receiving: small replies (``+OK``, integers, errors, ``INFO`` text, ``CLUSTER SLOTS``) are parsed
from a 64 KiB receive buffer. A block value is read by :meth:`RedisConnection.read_value_into`:
its ``$<length>`` line and header come through the buffer (the receive asks for just those bytes),
then the payload is received with ``recv_into`` straight into the caller's ``memoryview`` (the
host slot: one copy, kernel to slot) and its xxh3-64 is computed while it is hot in cache. A value
whose length is not the expected one is skipped without a byte reaching the caller's buffer.

Timeouts: one deadline per operation, not per call. :meth:`RedisConnection.begin` starts an
operation (``timeout_s`` from now, by default); every send and receive until the next ``begin``
must finish by then, so a server that trickles its reply a byte at a time still gives up at the
deadline. Before each call the time left is set as the kernel's ``SO_RCVTIMEO`` /
``SO_SNDTIMEO`` on plain TCP (so one ``recv(MSG_WAITALL)`` still receives a whole payload: one
wake-up, the GIL released throughout) or as Python's socket timeout on TLS. Past the deadline,
``TimeoutError``. A connection that timed out, broke or was handed a reply it cannot parse is
unusable (its place in the reply stream is lost): :attr:`RedisConnection.broken` is set, and its
owner closes it and opens another.

Errors: network failures are ``OSError`` (``TimeoutError`` for timeouts, :class:`ProtocolError`
for a stream that is not RESP or ends early); an error reply of the server is returned (not
raised) as a :class:`RespError`, so one failed command of a pipeline does not hide the others'
replies.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvoffload.errors import KVOffloadError

__all__ = [
    "ProtocolError",
    "RedisConnection",
    "RespError",
    "encode_command",
    "tls_context",
]

_BUFFER_BYTES = 64 * 1024
#: Buffers per ``sendmsg`` call (Linux's ``IOV_MAX`` is 1024).
_MAX_IOV = 1024
#: A reply line longer than this is not RESP.
_MAX_LINE = 64 * 1024
_CRLF = b"\r\n"


class RespError:
    """An error reply (``-ERR ...``, ``-MOVED ...``, ``-WRONGTYPE ...``): returned in a pipeline's
    results in place of the failed command's value. ``kind`` is its first word."""

    __slots__ = ("kind", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.kind = text.split(" ", 1)[0]

    def __repr__(self) -> str:
        return f"RespError({self.text!r})"


class ProtocolError(KVOffloadError, ConnectionError):
    """The server's bytes are not a RESP reply, or the connection closed in the middle of one."""


def encode_command(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def tls_context(options: Sequence[tuple[str, str]]) -> ssl.SSLContext:
    """An SSL context for the ``rediss://`` query options (redis-py's names: ``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``). Hostnames are checked when the
    certificate is required (the default)."""
    given = dict(options)
    context = ssl.create_default_context(cafile=given.get("ssl_ca_certs"))
    reqs = given.get("ssl_cert_reqs", "required")
    if reqs != "required":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE if reqs == "none" else ssl.CERT_OPTIONAL
    if "ssl_certfile" in given:
        context.load_cert_chain(given["ssl_certfile"], given.get("ssl_keyfile"))
    return context


def _timeval(seconds: float) -> bytes:
    """``seconds`` (> 0) as a ``struct timeval``, at least 1 µs (a zero one means "forever")."""
    micros = max(1, int(seconds * 1e6))
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


class RedisConnection:
    """A connected, authenticated connection to ``host:port`` (see the module docstring).

    Construction connects, then sends ``AUTH`` (when a password is given), ``CLIENT SETNAME``
    and ``SELECT`` (for ``db`` > 0) in one round trip: ``OSError`` if the server cannot be
    reached, :class:`RespErrorRaised` carrying the server's first error reply if it refuses.
    Not thread-safe: one thread uses a connection at a time.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        *,
        tls: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
    ) -> None:
        self.address = (host, port)
        self.broken = False
        self._buf = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
                self._waitall = 0
            else:
                sock.settimeout(None)  # blocking: the kernel's timeouts (_left) bound each call
                self._waitall = socket.MSG_WAITALL
            self._sock: socket.socket = sock
            self._tls = tls is not None
            self._handshake(username, password, db)
        except BaseException:
            sock.close()
            raise

    def begin(self, timeout_s: float | None = None) -> None:
        """Start an operation: its sends and receives must all be done within ``timeout_s``
        (default: the connection's) from now, however the server's bytes arrive."""
        self._deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)

    def _left(self, option: int) -> None:
        """Bound the next socket call by the time left to the deadline (``option``:
        ``SO_RCVTIMEO`` or ``SO_SNDTIMEO``); ``TimeoutError`` once it passed."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            self.broken = True
            raise TimeoutError(f"the operation took longer than {self._timeout_s} s")
        if self._tls:
            self._sock.settimeout(left)
        else:
            self._sock.setsockopt(socket.SOL_SOCKET, option, _timeval(left))

    def _handshake(self, username: str | None, password: str | None, db: int) -> None:
        commands = []
        if password is not None:
            auth = (username, password) if username else (password,)
            commands.append(encode_command("AUTH", *auth))
        commands.append(encode_command("CLIENT", "SETNAME", "kvoffload"))
        if db:
            commands.append(encode_command("SELECT", db))
        self.send([b"".join(commands)])
        replies = [self.read_reply() for _ in commands]
        for reply in replies:
            if isinstance(reply, RespError):
                raise RespErrorRaised(reply)

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def call(self, *args: bytes | str | int) -> Any:
        """Send one command and return its reply (a :class:`RespError` is raised as
        :class:`RespErrorRaised`)."""
        self.begin()
        self.send([encode_command(*args)])
        reply = self.read_reply()
        if isinstance(reply, RespError):
            raise RespErrorRaised(reply)
        return reply

    # ------------------------------------------------------------------ sending

    def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Send every buffer, in order (``sendmsg`` on plain TCP: nothing is joined), by the
        current operation's deadline (:meth:`begin`)."""
        try:
            if self._tls:
                for buf in buffers:
                    self._left(socket.SO_SNDTIMEO)
                    self._sock.sendall(buf)
                return
            pending = list(buffers)
            while pending:
                batch = pending[:_MAX_IOV]
                self._left(socket.SO_SNDTIMEO)
                sent = self._sock.sendmsg(batch)
                total = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in batch)
                if sent == total:
                    del pending[: len(batch)]
                    continue
                pending = _advance(pending, sent)
        except (BlockingIOError, TimeoutError):  # the deadline passed while sending
            self.broken = True
            raise TimeoutError(f"no room to send within {self._timeout_s} s") from None
        except OSError:
            self.broken = True
            raise

    # ---------------------------------------------------------------- receiving

    def _recv(self, view: memoryview, flags: int = 0) -> int:
        """Receive into ``view`` (at least one byte; all of it with ``MSG_WAITALL``), by the
        current operation's deadline."""
        self._left(socket.SO_RCVTIMEO)
        try:
            got = self._sock.recv_into(view, len(view), flags)
        except (BlockingIOError, TimeoutError):  # the deadline passed while waiting
            self.broken = True
            raise TimeoutError(f"no answer within {self._timeout_s} s") from None
        except OSError:
            self.broken = True
            raise
        if not got:
            self.broken = True
            raise ProtocolError("the server closed the connection")
        return got

    def _fill(self, hint: int) -> None:
        """Receive more bytes into the buffer: at least one, at most ``hint`` (so that a value's
        payload is not pulled into the buffer when only its header was wanted)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = self._end - self._start
            self._buf[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        room = len(self._buf) - self._end
        want = min(room, max(hint, 1))
        self._end += self._recv(self._view[self._end : self._end + want])

    def _line(self, hint: int = _BUFFER_BYTES) -> bytes:
        """The next reply line, without its CRLF."""
        buf = self._buf
        at = buf.find(_CRLF, self._start, self._end)
        while at < 0:
            if self._end - self._start > _MAX_LINE:
                self.broken = True
                raise ProtocolError("a reply line longer than 64 KiB")
            searched = max(0, self._end - self._start - 1)  # _fill may move the bytes
            self._fill(hint)
            at = buf.find(_CRLF, self._start + searched, self._end)
        line = bytes(self._view[self._start : at])
        self._start = at + 2
        return line

    def _take_into(self, target: memoryview, digest: bool = False) -> int:
        """Fill ``target`` from the buffer, then straight from the socket. Returns the xxh3-64
        of ``target`` when ``digest`` (else 0)."""
        size = len(target)
        done = min(self._end - self._start, size)
        if done:
            target[:done] = self._view[self._start : self._start + done]
            self._start += done
        while done < size:
            done += self._recv(target[done:], self._waitall)
        if not digest:
            return 0
        hasher = xxhash.xxh3_64()
        hasher.update(target)  # releases the GIL for payloads over 64 KiB
        return hasher.intdigest()

    def _take(self, size: int) -> bytes:
        if self._end - self._start >= size:
            data = bytes(self._view[self._start : self._start + size])
            self._start += size
            return data
        out = bytearray(size)
        self._take_into(memoryview(out))
        return bytes(out)

    def _skip(self, size: int) -> None:
        """Discard ``size`` bytes of the stream (they never leave the receive buffer)."""
        while size:
            have = self._end - self._start
            if not have:
                self._fill(min(size, len(self._buf)))
                continue
            step = min(have, size)
            self._start += step
            size -= step

    def _crlf(self, hint: int = 2) -> None:
        while self._end - self._start < 2:
            self._fill(hint)
        if self._view[self._start : self._start + 2] != _CRLF:
            self.broken = True
            raise ProtocolError("a bulk reply without its CRLF")
        self._start += 2

    def read_reply(self) -> Any:
        """The next reply: ``bytes`` (simple and bulk strings), ``int``, ``list``, ``None`` (a
        nil), or a :class:`RespError`."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest
            if kind == b"-":
                return RespError(rest.decode(errors="replace"))
            if kind == b":":
                return int(rest)
            if kind == b"$":
                size = int(rest)
                if size < 0:
                    return None
                data = self._take(size)
                self._crlf()
                return data
            if kind == b"*":
                count = int(rest)
                return None if count < 0 else [self.read_reply() for _ in range(count)]
        except ValueError:
            pass
        self.broken = True
        raise ProtocolError(f"not a RESP reply: {line[:40]!r}")

    def read_value_into(
        self,
        head_len: int,
        target: memoryview,
        next_hint: int,
        accept: Callable[[bytes], object] | None = None,
        spill: Callable[[int], memoryview] | None = None,
    ) -> object:
        """The reply to a ``GET`` of a value expected to be ``head_len`` header bytes followed by
        ``len(target)`` payload bytes: ``(header, xxh3-64 of the payload)`` with the payload in
        ``target``; ``None`` for a missing key; ``"corrupt"`` for a value of another length;
        a :class:`RespError` for an error reply. ``accept(header)``, called before the payload
        is received, returns ``None`` to receive it, or anything else to skip it and return
        that. Skipped values never reach ``target``. ``next_hint`` is how many bytes the next
        reply's length line and header take (0: none follows), so that they are received with
        this reply's final CRLF. With ``spill``, a value shorter than expected (but not shorter
        than its header) is received too: its payload of ``n`` bytes into ``spill(n)`` (a
        buffer of ``n`` bytes) instead of ``target``."""
        size = head_len + len(target)
        line = self._line(len(b"$%d\r\n" % size) + head_len)
        kind = line[:1]
        if kind == b"$" and line[1:].lstrip(b"-").isdigit():
            length = int(line[1:])
            if length < 0:
                return None
            if length != size:
                if spill is None or not head_len <= length < size:
                    self._skip(length)
                    self._crlf(2 + next_hint)
                    return "corrupt"
                target = spill(length - head_len)
            header = self._take(head_len)
            verdict = None if accept is None else accept(header)
            if verdict is not None:
                self._skip(len(target))
                self._crlf(2 + next_hint)
                return verdict
            digest = self._take_into(target, digest=True)
            self._crlf(2 + next_hint)
            return header, digest
        if kind == b"-":
            return RespError(line[1:].decode(errors="replace"))
        self.broken = True
        raise ProtocolError(f"not a GET reply: {line[:40]!r}")


class RespErrorRaised(KVOffloadError):
    """A server's error reply raised where the caller expected success (a handshake, a single
    :meth:`RedisConnection.call`)."""

    def __init__(self, error: RespError) -> None:
        super().__init__(error.text)
        self.error = error

    def __reduce__(self) -> tuple[type[RespErrorRaised], tuple[RespError]]:
        return type(self), (self.error,)


def _advance(buffers: list[bytes | memoryview], sent: int) -> list[bytes | memoryview]:
    """``buffers`` less their first ``sent`` bytes."""
    for i, buf in enumerate(buffers):
        size = len(buf) if isinstance(buf, bytes) else buf.nbytes
        if sent < size:
            return [memoryview(buf)[sent:], *buffers[i + 1 :]]
        sent -= size
    return []
