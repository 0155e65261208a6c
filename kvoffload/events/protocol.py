"""ZMQ framing shared by the publisher and the subscriber (vLLM's, unchanged).

Live stream (PUB): multipart ``[topic, seq, payload]``; ``seq`` counts the batches a publisher
has accepted, from 0, as 8 big-endian bytes; ``payload`` is the msgpack batch.

Replay (ROUTER): a client (DEALER) sends ``[b"", start_seq]``; the publisher answers with one
``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq``, in order, then the
end marker ``[b"", b"", REPLAY_END, b""]`` (an empty topic), as vLLM 0.33's publisher does.

Who binds: vLLM's publisher binds a wildcard or ipc/inproc address and connects to any other
(:func:`publisher_binds`); kvoffload's publishers also bind a loopback address
(:func:`binds_by_default`), so that ``tcp://127.0.0.1:P`` works with subscribers that connect.
Events carry every prompt's token ids: :func:`exposed_beyond_host` says whether an address
reaches beyond this host.
"""

from __future__ import annotations

import ipaddress

__all__ = [
    "REPLAY_END",
    "SEQ_BYTES",
    "binds_by_default",
    "decode_seq",
    "encode_seq",
    "exposed_beyond_host",
    "offset_endpoint",
    "publisher_binds",
]

SEQ_BYTES = 8
#: The seq frame that ends a replay answer: -1 as 8 signed big-endian bytes.
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """Return the seq frame of ``seq`` (0 <= seq < 2**63)."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """Return the sequence number in a seq frame (-1 for :data:`REPLAY_END`).

    Raises ``ValueError`` when the frame is not 8 bytes long.
    """
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a seq frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def publisher_binds(endpoint: str) -> bool:
    """Say whether a publisher binds ``endpoint`` (else it connects to a subscriber that binds).

    vLLM's rule: bind when the address is a wildcard (``*``, including ZMQ's ``tcp://host:*``
    ephemeral port, or ``::``) or the transport is ``ipc://`` or ``inproc://``.
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` address (brackets of an IPv6 host removed)."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a wildcard, a host name, an interface name
        return False


def exposed_beyond_host(endpoint: str) -> bool:
    """Whether a socket bound at ``endpoint`` can be reached from other hosts: a tcp address
    whose host is not a loopback address (a wildcard ``*``, ``0.0.0.0``, ``::``, another IP, a
    host or interface name). ipc and inproc addresses stay on this host."""
    host = _tcp_host(endpoint)
    return host is not None and not _is_loopback_host(host)


def binds_by_default(endpoint: str) -> bool:
    """kvoffload's publishers' rule: vLLM's (:func:`publisher_binds`), and a loopback tcp
    address (``tcp://127.0.0.1:P``, ``tcp://localhost:P``, ``tcp://[::1]:P``) binds too: on this
    host, the subscriber (``route``, ``events listen``) connects."""
    host = _tcp_host(endpoint)
    return publisher_binds(endpoint) or (host is not None and _is_loopback_host(host))


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Return the address of data-parallel rank ``data_parallel_rank``'s publisher.

    As vLLM does, a tcp port is offset by the rank (``tcp://*:5557`` -> ``tcp://*:5558`` for rank
    1); an ephemeral port (``:*``) is left alone. ipc and inproc names get a ``_dp<rank>`` suffix
    for ranks above 0.
    """
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}" if port.isdigit() else endpoint
    return f"{endpoint}_dp{data_parallel_rank}"
