"""The engine's paged KV-cache block pool with prefix caching."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvoffload.errors import ContractError
from kvoffload.keys import BlockHash

__all__ = ["BlockPool", "KVBlock"]


class KVBlock:
    """One engine block. ``ref_cnt``: requests using it; ``block_hash``: set once it holds a full,
    computed block registered in the prefix cache. Only :class:`BlockPool` mutates these."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None


class BlockPool:
    """Fixed pool of ``num_blocks`` engine blocks with a prefix cache.

    Free blocks wait in one LRU queue (front = reused first). Blocks without a hash are put at the
    front (nothing to lose), cached blocks at the back. A request's blocks are freed tail first, so
    that among blocks freed together the tail of a prefix is reused before its head. Reusing a
    cached block evicts it from the prefix cache. A hash maps to at most one block; a second block
    computed with the same hash simply stays uncached.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        #: Called with the hash of every block leaving the prefix cache (for KV events).
        self.on_evicted: Callable[[BlockHash], None] | None = None
        self.num_evicted = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def find_cached_prefix(
        self, block_hashes: Sequence[BlockHash], max_blocks: int
    ) -> list[KVBlock]:
        """The cached blocks of the leading run of ``block_hashes[:max_blocks]`` (not taken)."""
        if not self.enable_caching:
            return []
        cached = self._cached
        out: list[KVBlock] = []
        for h in block_hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def is_cached(self, block_hash: BlockHash) -> bool:
        """Whether the prefix cache holds a block with ``block_hash``."""
        return block_hash in self._cached

    def take(self, blocks: Sequence[KVBlock]) -> None:
        """Add a reference to each of ``blocks`` (prefix-cache hits), removing free ones from the queue."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock] | None:
        """Take ``n`` free blocks (evicting their cached contents), or return ``None`` if too few."""
        if n > len(self._free):
            return None
        out: list[KVBlock] = []
        free = self._free
        for _ in range(n):
            _, block = free.popitem(last=False)
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each of ``blocks``; blocks reaching zero become reusable."""
        free = self._free
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                if block.block_hash is None:
                    free.move_to_end(block.block_id, last=False)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"bug: block {block.block_id} freed more often than taken")

    def cache(
        self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash], start: int, end: int
    ) -> list[int]:
        """Register ``blocks[start:end]`` (full and computed) under ``block_hashes[start:end]``.

        Returns the indices that entered the prefix cache (not those already cached or duplicates).
        """
        added: list[int] = []
        if not self.enable_caching:
            return added
        cached = self._cached
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            h = block_hashes[i]
            if h in cached:
                continue
            block.block_hash = h
            cached[h] = block
            added.append(i)
        return added

    def _uncache(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is None:
            raise ContractError(f"block {block.block_id} is not cached: it has no hash")
        del self._cached[h]
        block.block_hash = None
        self.num_evicted += 1
        if self.on_evicted is not None:
            self.on_evicted(h)

    def drop_cached(self) -> int:
        """Uncache every free cached block (an operator's clear; blocks in use stay cached),
        each announced through :attr:`on_evicted`; returns how many."""
        dropped = [block for block in self._free.values() if block.block_hash is not None]
        for block in dropped:
            self._uncache(block)
        return len(dropped)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True
