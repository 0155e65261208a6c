"""``PrefixIndex``: which instance holds which block in which tier, kept live from KV events.

Blocks are keyed by the router's content hash (:mod:`kvoffload.routing.keys`), so events of
every backend and every incoming prompt share one key space; the engine's own hash is kept only
to resolve removals and parents. A ``BlockStored`` that carries its tokens (every kvoffload event
does) is hashed from its parent's key; an offloaded block spanning several engine blocks gets one
key per engine block. A token-less ``BlockStored`` (vLLM's offloading events, a disk tier's
discovered blocks) takes the keys already learned for its engine hash, or is counted as
unresolved. Events are accepted in vLLM 0.33's map form and the older array form (the codec
decodes both).

Tiers: ``device`` (medium ``GPU``), ``host`` (``CPU``), ``disk`` (``STORAGE``, local or no
locality, and any unknown medium), ``remote`` (``STORAGE`` / ``REMOTE``: a store shared between
instances; a block there is a hit for every instance of the same ``remote_group``).
``AllBlocksCleared`` (a device prefix-cache reset) drops the instance's device entries; its
tiers announce their own removals.

Cost: a few dict operations per block and event; :meth:`match` walks the prompt's blocks only
as far as some instance still holds them. Not thread-safe: the router serialises access.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.events.messages import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
)
from kvoffload.routing.keys import ROOT_SEED, block_keys, token_bytes

__all__ = ["DEVICE", "DISK", "HOST", "REMOTE", "TIERS", "Match", "PrefixIndex", "tier_of"]

DEVICE, HOST, DISK, REMOTE = 0, 1, 2, 3
TIERS = ("device", "host", "disk", "remote")
_MASK = tuple(0xFFFF << (16 * t) for t in range(4))  # a tier's refcount in a packed entry
_MAX_LEARNED = 1 << 21  # engine hashes whose keys are remembered (oldest forgotten first)

HeldKey = tuple[int, ExternalBlockHash]  # (group, engine hash)


def tier_of(medium: str | None, locality: str | None) -> int:
    """The index's tier of an event's medium and locality."""
    if medium is None or medium == MEDIUM_GPU:
        return DEVICE
    if medium == MEDIUM_CPU:
        return HOST
    if medium == MEDIUM_STORAGE and locality == LOCALITY_REMOTE:
        return REMOTE
    return DISK


@dataclass(slots=True)
class Match:
    """What an instance holds of a prompt, in the order the engine would use it: a run of
    ``device`` blocks from the start, then blocks it would load (each from the first tier the
    engine asks that holds it: host, disk, remote); the rest (of ``total`` blocks) is computed."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0
    total: int = 0

    @property
    def cached(self) -> int:
        return self.device + self.host + self.disk + self.remote

    @property
    def computed(self) -> int:
        return self.total - self.cached


class PrefixIndex:
    """Blocks of every instance and tier; instances are small ints from :meth:`add_instance`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # key -> {instance: refcounts of device, host, disk, remote packed 16 bits each}: ints
        # only, so the garbage collector never traverses the index's entries.
        self._blocks: dict[int, dict[int, int]] = {}
        # per instance, per tier: (group, engine hash) -> keys of that block
        self._held: dict[int, list[dict[HeldKey, tuple[int, ...]]]] = {}
        self._remote_group: dict[int, str | None] = {}
        self._key_of: dict[ExternalBlockHash, int] = {}  # engine hash -> its engine block's key
        self._span_of: dict[ExternalBlockHash, tuple[int, ...]] = {}  # longest span seen
        self._next_id = 0
        self.counters = dict.fromkeys(
            ("stored", "removed", "cleared", "unknown_parent", "unresolved", "unknown_removal"), 0
        )

    # -- instances ---------------------------------------------------------------------------

    def add_instance(self, remote_group: str | None = None) -> int:
        instance = self._next_id
        self._next_id += 1
        self._held[instance] = [{} for _ in TIERS]
        self._remote_group[instance] = remote_group
        return instance

    def remove_instance(self, instance: int) -> None:
        """Forget the instance and every entry it had."""
        self.clear(instance)
        self._held.pop(instance, None)
        self._remote_group.pop(instance, None)

    def clear(self, instance: int, tiers: Iterable[int] = range(len(TIERS))) -> None:
        """Drop the instance's entries in ``tiers`` (all by default)."""
        held = self._held.get(instance)
        if held is None:
            return
        for tier in tiers:
            for keys in held[tier].values():
                self._unref(instance, tier, keys)
            held[tier].clear()

    # -- events ------------------------------------------------------------------------------

    def apply(self, instance: int, events: Iterable[KVCacheEvent]) -> None:
        """Apply an instance's events, in order (unknown instances are ignored)."""
        held = self._held.get(instance)
        if held is None:
            return
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(instance, held, event)
            elif isinstance(event, BlockRemoved):
                tier = held[tier_of(event.medium, event.locality)]
                t = tier_of(event.medium, event.locality)
                group = event.group_idx or 0
                for h in event.block_hashes:
                    keys = tier.pop((group, h), None)
                    if keys is None:
                        self.counters["unknown_removal"] += 1
                    else:
                        self._unref(instance, t, keys)
                        self.counters["removed"] += 1
            elif isinstance(event, AllBlocksCleared):
                self.clear(instance, (DEVICE,))
                self.counters["cleared"] += 1

    def _stored(self, instance: int, held: list[dict], event: BlockStored) -> None:
        t = tier_of(event.medium, event.locality)
        group = event.group_idx or 0
        ebs = self.block_size
        hashes, tokens, size = event.block_hashes, event.token_ids, event.block_size
        if tokens and size and size % ebs == 0 and len(tokens) == len(hashes) * size:
            parent = event.parent_block_hash
            key = ROOT_SEED if parent is None else self._key_of.get(parent)
            if key is None:
                self.counters["unknown_parent"] += len(hashes)
                return
            per = size // ebs
            keys_iter = block_keys(token_bytes(tokens), ebs, key)
            for h in hashes:
                keys = tuple(next(keys_iter) for _ in range(per))
                self._learn(h, keys)
                self._add(instance, held[t], t, (group, h), keys)
            return
        for h in hashes:  # token-less: keys already learned from a described event
            keys = self._span_of.get(h)
            if keys is None or (size and len(keys) * ebs != size):
                self.counters["unresolved"] += 1
                continue
            self._add(instance, held[t], t, (group, h), keys)

    def _learn(self, h: ExternalBlockHash, keys: tuple[int, ...]) -> None:
        key_of, span_of = self._key_of, self._span_of
        if h not in key_of:
            if len(key_of) >= _MAX_LEARNED:
                oldest = next(iter(key_of))
                del key_of[oldest]
                span_of.pop(oldest, None)
            key_of[h] = keys[-1]
        known = span_of.get(h)
        if known is None or len(known) < len(keys):
            span_of[h] = keys

    def _add(
        self, instance: int, tier: dict[HeldKey, tuple[int, ...]], t: int, held_key: HeldKey,
        keys: tuple[int, ...],
    ) -> None:
        if held_key in tier:
            return
        tier[held_key] = keys
        self.counters["stored"] += 1
        blocks = self._blocks
        for key in keys:
            entry = blocks.get(key)
            if entry is None:
                entry = blocks[key] = {}
            entry[instance] = entry.get(instance, 0) + (1 << (16 * t))

    def _unref(self, instance: int, t: int, keys: tuple[int, ...]) -> None:
        blocks = self._blocks
        for key in keys:
            entry = blocks.get(key)
            counts = None if entry is None else entry.get(instance)
            if counts is None:
                continue
            counts -= 1 << (16 * t)
            if counts:
                entry[instance] = counts
            else:
                del entry[instance]
                if not entry:
                    del blocks[key]

    # -- queries -----------------------------------------------------------------------------

    def match(self, data: bytes, instances: Sequence[int]) -> dict[int, Match]:
        """What each of ``instances`` holds of the prompt whose :func:`token_bytes` are
        ``data``. Walks the prompt's blocks only while some instance still matches."""
        total = len(data) // (self.block_size * 4)
        out = {i: Match(total=total) for i in instances}
        on_device = {i: True for i in instances}
        alive = list(instances)
        groups = self._remote_group
        blocks = self._blocks
        for key in block_keys(data, self.block_size):
            entry = blocks.get(key)
            if entry is None:
                break
            remote_groups: set[str | None] | None = None
            still = []
            for i in alive:
                counts = entry.get(i, 0)
                m = out[i]
                if counts & _MASK[DEVICE] and on_device[i]:
                    m.device += 1
                elif counts & _MASK[HOST]:
                    m.host += 1
                elif counts & _MASK[DISK]:
                    m.disk += 1
                else:
                    if remote_groups is None:
                        remote_groups = {groups.get(j) for j, c in entry.items() if c & _MASK[REMOTE]}
                        remote_groups.discard(None)
                    if groups.get(i) not in remote_groups:
                        continue
                    m.remote += 1
                on_device[i] = on_device[i] and m.host + m.disk + m.remote == 0
                still.append(i)
            alive = still
            if not alive:
                break
        return out

    def held(self, instance: int, tier: int) -> set[HeldKey]:
        """The (group, engine hash) pairs the instance holds in ``tier`` (for checks)."""
        held = self._held.get(instance)
        return set() if held is None else set(held[tier])

    def num_blocks(self, instance: int | None = None) -> int:
        """Indexed engine blocks (of one instance, or in all)."""
        if instance is not None:
            held = self._held.get(instance)
            return 0 if held is None else sum(len(t) for t in held)
        return sum(len(t) for held in self._held.values() for t in held)

    def num_keys(self) -> int:
        return len(self._blocks)
