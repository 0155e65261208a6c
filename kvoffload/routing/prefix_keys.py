"""The router's block keys: a chained 64-bit hash of each full block's token ids.

``key[i] = xxh3_64(tokens of block i, seed=key[i-1])`` with ``key[-1] =`` :data:`ROOT_SEED`
(Dynamo's seed), token ids as little-endian uint32. The router keys blocks by their content, not
by the engine's hash (vLLM's can be seeded per process), so every backend's events and every
incoming prompt meet in one key space. A partial trailing block has no key (engines cache whole
blocks only).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import xxhash

__all__ = ["ROOT_SEED", "block_keys", "token_bytes"]

ROOT_SEED = 1337
_hash = xxhash.xxh3_64_intdigest


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids packed as little-endian uint32 (ids must be in ``[0, 2**32)``)."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on has 4-byte "I"
        packed = array("L", token_ids)
    return packed.tobytes()


def block_keys(
    data: bytes, block_size: int, parent: int = ROOT_SEED, limit: int | None = None
) -> Iterator[int]:
    """The keys of the full blocks in ``data`` (from :func:`token_bytes`), lazily, chained
    from ``parent``; at most ``limit`` of them."""
    stride = block_size * 4
    count = len(data) // stride
    if limit is not None:
        count = min(count, limit)
    key = parent
    for offset in range(0, count * stride, stride):
        key = _hash(data[offset : offset + stride], key)
        yield key
