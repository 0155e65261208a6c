"""Offload keys and prefix-chained block hashing.

An :data:`OffloadKey` names one offloaded block of one KV-cache group: the block hash bytes
followed by the group index as 4 big-endian bytes. Bytes, not tuples, so that millions of keys
cost the garbage collector nothing.

Block hashes are chained: block *i*'s hash covers its tokens, its extra keys and the hash of
block *i-1*, so one hash identifies the whole prefix up to and including that block. Hashes are
deterministic across processes and restarts (Python's ``hash()`` is never used).

Schemes (:data:`HASH_SCHEMES`), versioned by name so that a stored block can say how its key
was made:

``sha256_cbor`` (default)
    ``sha256(cbor2.dumps((parent, tuple(token_ids), extra_keys), canonical=True))``: the scheme
    vLLM uses, so our hashes equal vLLM's for the same tokens and seed.
``xxh3_128``
    xxh3-128 over ``parent || token ids as uint32 little-endian || cbor(extra_keys)`` (token ids
    must be below 2**32). About 10x
    faster; not collision resistant against an adversary.

The seed (root) hash: the first block's parent is ``H(seed)``, where ``H`` is the scheme's hash of
the seed *string*. vLLM computes its ``NONE_HASH`` the same way from ``PYTHONHASHSEED``, so
``BlockHasher(seed="0")`` (our default) matches vLLM started with ``PYTHONHASHSEED=0``. Instances
that share offloaded blocks must use the same scheme and seed.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2
import xxhash

from kvoffload.errors import ConfigError

__all__ = [
    "HASH_SCHEMES",
    "BlockHash",
    "BlockHasher",
    "OffloadKey",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
]

BlockHash = NewType("BlockHash", bytes)
OffloadKey = NewType("OffloadKey", bytes)

_GROUP_BYTES = 4
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """Return the key of block ``block_hash`` in KV-cache group ``group_idx`` (0 <= idx < 2**32)."""
    return OffloadKey(block_hash + group_idx.to_bytes(_GROUP_BYTES, "big"))


def offload_key_hash(key: OffloadKey) -> BlockHash:
    """Return the block-hash part of ``key``."""
    return BlockHash(key[:-_GROUP_BYTES])


def offload_key_group(key: OffloadKey) -> int:
    """Return the KV-cache group index of ``key``."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_cbor_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any) -> bytes:
    return _sha256_cbor((parent, tuple(token_ids), extra_keys))


def _xxh3_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any) -> bytes:
    h = xxhash.xxh3_128(parent)
    packed = array("I", token_ids)  # token ids must fit uint32
    if _BIG_ENDIAN_HOST:
        packed.byteswap()
    h.update(packed.tobytes())
    if extra_keys is not None:
        h.update(cbor2.dumps(extra_keys, canonical=True))
    return h.digest()


def _xxh3_seed(seed: str) -> bytes:
    return xxhash.xxh3_128_digest(seed.encode())


# name -> (hash of one block, hash of the seed string)
HASH_SCHEMES: dict[
    str, tuple[Callable[[bytes, Sequence[int], Any], bytes], Callable[[str], bytes]]
] = {
    "sha256_cbor": (_sha256_cbor_block, _sha256_cbor),
    "xxh3_128": (_xxh3_block, _xxh3_seed),
}


class BlockHasher:
    """Computes prefix-chained block hashes under one scheme and seed.

    Stateless after construction and safe to share between threads.
    """

    __slots__ = ("_hash_block", "block_size", "root_hash", "scheme", "seed")

    def __init__(self, block_size: int, scheme: str = "sha256_cbor", seed: str = "0") -> None:
        if scheme not in HASH_SCHEMES:
            raise ConfigError(
                "hash_scheme", f"unknown scheme {scheme!r}; choose from {sorted(HASH_SCHEMES)}"
            )
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError("block_size", f"must be a positive integer, got {block_size!r}")
        if not isinstance(seed, str):
            # vLLM hashes the PYTHONHASHSEED *string*; any other type would silently change the root.
            raise ConfigError("hash_seed", f"must be a string, got {seed!r}")
        self.block_size = block_size
        self.scheme = scheme
        self.seed = seed
        hash_block, hash_seed = HASH_SCHEMES[scheme]
        self._hash_block = hash_block
        self.root_hash = BlockHash(hash_seed(seed))

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: Any = None
    ) -> BlockHash:
        """Return the hash of one block given its parent's hash (``None`` for the first block)."""
        return BlockHash(
            self._hash_block(self.root_hash if parent is None else parent, token_ids, extra_keys)
        )

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        extra_keys: Any = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Return the chained hashes of every *full* block of ``token_ids``, from ``start_block``.

        ``parent`` is the hash of block ``start_block - 1`` (``None`` when ``start_block == 0``), so
        a growing request can hash only its new blocks. A trailing partial block is not hashed.
        ``extra_keys`` (a LoRA name, a cache salt: anything CBOR can encode) applies to every block.
        """
        bs = self.block_size
        hash_block = self._hash_block
        prev = self.root_hash if parent is None else parent
        out: list[BlockHash] = []
        for start in range(start_block * bs, len(token_ids) - bs + 1, bs):
            prev = hash_block(prev, token_ids[start : start + bs], extra_keys)
            out.append(BlockHash(prev))
        return out
