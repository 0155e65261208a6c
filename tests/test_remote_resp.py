"""The RESP reader of :class:`RedisConnection` against a scripted server of ours on loopback:
replies cut into TCP pieces at every possible place, values received straight into their
buffers exactly, values of the wrong length skipped without a byte reaching their buffer."""

from __future__ import annotations

import socket
import threading
import time

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.tiers.redis.connection import RedisConnection, RespError

HEAD = 16  # header bytes of every value in these tests


def scripted_server(stream: bytes, pieces: list[int]) -> tuple[int, threading.Thread]:
    """A one-connection server: answers the handshake (``CLIENT SETNAME``) with ``+OK``, then
    sends ``stream`` cut after each length in ``pieces`` (cycled), a pause between pieces."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(10)
            got = b""
            while b"kvoffload\r\n" not in got:
                got += conn.recv(1024)
            conn.sendall(b"+OK\r\n")
            at, i = 0, 0
            while at < len(stream):
                step = pieces[i % len(pieces)]
                conn.sendall(stream[at : at + step])
                at, i = at + step, i + 1
                time.sleep(0.0002)
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def reply_of(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


values = st.lists(
    st.one_of(
        st.none(),
        st.binary(min_size=HEAD, max_size=HEAD + 300),
        st.just(b"-WRONGTYPE Operation against a key holding the wrong kind of value"),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(
    replies=values,
    pieces=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    expected=st.integers(0, 300),
)
def test_values_cut_anywhere_land_exactly(
    replies: list[bytes | None], pieces: list[int], expected: int
) -> None:
    """Every reply is a missing key, a value (of the expected payload length or not) or an
    error reply; each is read into its own buffer with the read-ahead hints the transport
    uses. Results and buffers are exact; a wrong-length value leaves its buffer untouched."""
    stream = b"".join(
        r + b"\r\n" if r is not None and r.startswith(b"-WRONGTYPE") else reply_of(r)
        for r in replies
    )
    port, server = scripted_server(stream, pieces)
    conn = RedisConnection("127.0.0.1", port, timeout_s=10)
    try:
        hint = len(b"$%d\r\n" % (HEAD + expected)) + HEAD
        for n, reply in enumerate(replies):
            target = bytearray(b"\xee" * expected)
            last = n == len(replies) - 1
            got = conn.read_value_into(HEAD, memoryview(target), 0 if last else hint)
            if reply is None:
                assert got is None
            elif reply.startswith(b"-WRONGTYPE"):
                assert isinstance(got, RespError) and got.kind == "WRONGTYPE"
            elif len(reply) != HEAD + expected:
                assert got == "corrupt" and target == b"\xee" * expected
            else:
                assert got == (reply[:HEAD], xxhash.xxh3_64_intdigest(reply[HEAD:]))
                assert target == reply[HEAD:]
            assert not conn.broken
    finally:
        conn.close()
        server.join(10)


def test_a_header_refused_skips_its_payload() -> None:
    """``accept`` sees the header before the payload arrives; a refusal is returned and the
    payload never reaches the buffer; the next value still lands."""
    first, second = b"H" * HEAD + b"a" * 32, b"h" * HEAD + b"b" * 32
    port, server = scripted_server(reply_of(first) + reply_of(second), [7])
    conn = RedisConnection("127.0.0.1", port, timeout_s=10)
    try:
        target = bytearray(32)
        assert conn.read_value_into(HEAD, memoryview(target), 64, lambda h: "layout") == "layout"
        assert target == bytes(32)
        got = conn.read_value_into(HEAD, memoryview(target), 0, lambda h: None)
        assert isinstance(got, tuple) and got[0] == b"h" * HEAD and target == b"b" * 32
    finally:
        conn.close()
        server.join(10)
