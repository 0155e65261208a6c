"""ZMQ framing shared by the publisher and the subscriber (vLLM's, unchanged).

Live stream (PUB): multipart ``[topic, seq, payload]``; ``seq`` counts the batches a publisher
has accepted, from 0, as 8 big-endian bytes; ``payload`` is the msgpack batch.

Replay (ROUTER): a client (DEALER) sends ``[b"", start_seq]``; the publisher answers with one
``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq``, in order, then the
end marker ``[b"", b"", REPLAY_END, b""]`` (an empty topic), as vLLM 0.33's publisher does.
"""

from __future__ import annotations

__all__ = [
    "REPLAY_END",
    "SEQ_BYTES",
    "decode_seq",
    "encode_seq",
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
