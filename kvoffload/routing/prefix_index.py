"""``PrefixIndex``: which instance holds which block in which tier, kept live from KV events.

Blocks are keyed by the router's content hash (:mod:`kvoffload.routing.prefix_keys`), so events of
every backend and every incoming prompt share one key space; the engine's own hash is kept only
to resolve removals and parents. A ``BlockStored`` that carries its tokens (every kvoffload event
does) is hashed from its parent's key; an offloaded block spanning several engine blocks gets one
key per engine block. A token-less ``BlockStored`` (vLLM's offloading events, a disk tier's
discovered blocks) takes the keys already learned for its engine hash, or is counted as
unresolved. Events are accepted in vLLM 0.33's map form and the older array form (the codec
decodes both).

Tiers: :data:`~kvoffload.events.messages.TIERS`, named by
:func:`~kvoffload.events.messages.tier_of` (the events index's vocabulary): ``device`` (medium
``GPU``), ``host`` (``CPU``), ``disk`` (``STORAGE``, local or no locality, and any unknown
medium), ``remote`` (``STORAGE`` / ``REMOTE``: a store shared between instances; a block there is
a hit for every instance of the same ``remote_group``). Here a tier is its position in ``TIERS``
(:data:`DEVICE`, :data:`HOST`, :data:`DISK`, :data:`REMOTE`; :func:`tier_number`).
``AllBlocksCleared`` (a device prefix-cache reset) drops the instance's device entries; its
tiers announce their own removals. An instance's own ``REMOTE`` blocks count for it even when it
has no group.

Cost: a few dict operations per block and event; :meth:`match` walks the prompt's blocks only
as far as some instance still holds them. Not thread-safe: the router serialises access.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvoffload.events.messages import (
    TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    tier_of,
)
from kvoffload.routing.prefix_keys import ROOT_SEED, block_keys, token_bytes

__all__ = ["DEVICE", "DISK", "HOST", "REMOTE", "TIERS", "Match", "PrefixIndex", "tier_number"]

_NUMBER = {name: i for i, name in enumerate(TIERS)}
DEVICE, HOST, DISK, REMOTE = (_NUMBER[name] for name in ("device", "host", "disk", "remote"))
_ONE = tuple(1 << (16 * t) for t in range(4))  # one reference in a tier, packed
_MASK = tuple(0xFFFF << (16 * t) for t in range(4))  # a tier's refcount in a packed entry
_MAX_LEARNED = 1 << 21  # engine hashes whose keys are remembered (oldest forgotten first)

HeldKey = tuple[int, ExternalBlockHash]  # (group, engine hash), as held() reports it
#: An engine block's keys as stored: one key as an int, several packed as uint64 bytes.
Span = int | bytes


def tier_number(medium: str | None, locality: str | None) -> int:
    """The position in :data:`TIERS` of an event's tier (:func:`tier_of`)."""
    return _NUMBER[tier_of(medium, locality)]


def _span(keys: Sequence[int]) -> Span:
    return keys[0] if len(keys) == 1 else array("Q", keys).tobytes()


def _keys(span: Span) -> Iterable[int]:
    return (span,) if isinstance(span, int) else memoryview(span).cast("Q")


def _span_len(span: Span) -> int:
    return 1 if isinstance(span, int) else len(span) // 8


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
    """Blocks of every instance and tier; instances are small ints from :meth:`add_instance`.

    Garbage-collector-free by construction: every table maps ints (or bytes) to ints or bytes,
    so CPython never tracks them and a collection never walks the index, however large.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # per instance: key -> refcounts of device, host, disk, remote packed 16 bits each
        self._tiers: dict[int, dict[int, int]] = {}
        # per shared-tier group: key -> REMOTE references of its instances
        self._remote: dict[str, dict[int, int]] = {}
        self._refs: dict[int, int] = {}  # key -> references over every instance and tier
        # per instance, per tier: engine hash ((group, hash) outside group 0) -> its keys
        self._held: dict[int, list[dict[ExternalBlockHash | HeldKey, Span]]] = {}
        self._remote_group: dict[int, str | None] = {}
        self._key_of: dict[ExternalBlockHash, int] = {}  # engine hash -> its engine block's key
        self._span_of: dict[ExternalBlockHash, Span] = {}  # the longest span seen
        self._next_id = 0
        self.counters = dict.fromkeys(
            ("stored", "removed", "cleared", "unknown_parent", "unresolved", "unknown_removal"), 0
        )

    # -- instances ---------------------------------------------------------------------------

    def add_instance(self, remote_group: str | None = None) -> int:
        instance = self._next_id
        self._next_id += 1
        self._tiers[instance] = {}
        self._held[instance] = [{} for _ in TIERS]
        self._remote_group[instance] = remote_group
        if remote_group is not None:
            self._remote.setdefault(remote_group, {})
        return instance

    def remove_instance(self, instance: int) -> None:
        """Forget the instance and every entry it had."""
        self.clear(instance)
        self._held.pop(instance, None)
        self._tiers.pop(instance, None)
        self._remote_group.pop(instance, None)

    def clear(self, instance: int, tiers: Iterable[int] = range(len(TIERS))) -> None:
        """Drop the instance's entries in ``tiers`` (all by default)."""
        held = self._held.get(instance)
        if held is None:
            return
        for tier in tiers:
            for span in held[tier].values():
                self._unref(instance, tier, span)
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
                self._removed(instance, held, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(instance, (DEVICE,))
                self.counters["cleared"] += 1

    def _removed(self, instance: int, held: list[dict], event: BlockRemoved) -> None:
        t = tier_number(event.medium, event.locality)
        tier = held[t]
        group = event.group_idx or 0
        for h in event.block_hashes:
            span = tier.pop(h if not group else (group, h), None)
            if span is None:
                self.counters["unknown_removal"] += 1
            else:
                self._unref(instance, t, span)
                self.counters["removed"] += 1

    def _stored(self, instance: int, held: list[dict], event: BlockStored) -> None:
        t = tier_number(event.medium, event.locality)
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
            keys = list(block_keys(token_bytes(tokens), ebs, key))
            for i, h in enumerate(hashes):
                span = _span(keys[i * per : (i + 1) * per])
                self._learn(h, span, keys[(i + 1) * per - 1])
                self._add(instance, held[t], t, h if not group else (group, h), span)
            return
        for h in hashes:  # token-less: keys already learned from a described event
            learned = self._span_of.get(h)
            if learned is None or (size and _span_len(learned) * ebs != size):
                self.counters["unresolved"] += 1
                continue
            self._add(instance, held[t], t, h if not group else (group, h), learned)

    def _learn(self, h: ExternalBlockHash, span: Span, last_key: int) -> None:
        key_of, span_of = self._key_of, self._span_of
        if h not in key_of:
            if len(key_of) >= _MAX_LEARNED:
                oldest = next(iter(key_of))
                del key_of[oldest]
                span_of.pop(oldest, None)
            key_of[h] = last_key
        known = span_of.get(h)
        if known is None or _span_len(known) < _span_len(span):
            span_of[h] = span

    def _add(
        self, instance: int, tier: dict, t: int, held_key: ExternalBlockHash | HeldKey, span: Span
    ) -> None:
        if held_key in tier:
            return
        tier[held_key] = span
        self.counters["stored"] += 1
        mine, refs, one = self._tiers[instance], self._refs, _ONE[t]
        remote = self._remote.get(self._remote_group[instance]) if t == REMOTE else None  # type: ignore[arg-type]
        for key in _keys(span):
            mine[key] = mine.get(key, 0) + one
            refs[key] = refs.get(key, 0) + 1
            if remote is not None:
                remote[key] = remote.get(key, 0) + 1

    def _unref(self, instance: int, t: int, span: Span) -> None:
        mine, refs, one = self._tiers[instance], self._refs, _ONE[t]
        remote = self._remote.get(self._remote_group[instance]) if t == REMOTE else None  # type: ignore[arg-type]
        for key in _keys(span):
            counts = mine.get(key, 0) - one
            if counts > 0:
                mine[key] = counts
            else:
                mine.pop(key, None)
            _decrement(refs, key)
            if remote is not None:
                _decrement(remote, key)

    # -- queries -----------------------------------------------------------------------------

    def match(self, data: bytes, instances: Sequence[int]) -> dict[int, Match]:
        """What each of ``instances`` holds of the prompt whose :func:`token_bytes` are
        ``data``. Walks the prompt's blocks only while some instance still matches; allocates
        a few small lists per call, nothing per block (the garbage collector's trigger counts
        container allocations: a decision should not be the one that trips it)."""
        n = len(instances)
        total = len(data) // (self.block_size * 4)
        tables = [self._tiers.get(i, _EMPTY) for i in instances]
        remote = [self._remote.get(self._remote_group.get(i), _EMPTY) for i in instances]  # type: ignore[arg-type]
        # per instance: device run, host, disk, remote; on_device while the run lasts
        counts = [0] * (4 * n)
        on_device = [True] * n
        alive = list(range(n))
        refs = self._refs
        device_mask, host_mask, disk_mask, remote_mask = _MASK
        for key in block_keys(data, self.block_size):
            if key not in refs:
                break
            gone = None
            for j in alive:
                c = tables[j].get(key, 0)
                if c & device_mask and on_device[j]:
                    counts[4 * j] += 1
                    continue
                on_device[j] = False
                if c & host_mask:
                    counts[4 * j + 1] += 1
                elif c & disk_mask:
                    counts[4 * j + 2] += 1
                elif c & remote_mask or key in remote[j]:
                    counts[4 * j + 3] += 1
                elif gone is None:
                    gone = [j]  # at most one list per instance and call
                else:
                    gone.append(j)
            if gone is not None:
                alive = [j for j in alive if j not in gone]
                if not alive:
                    break
        return {
            i: Match(counts[4 * j], counts[4 * j + 1], counts[4 * j + 2], counts[4 * j + 3], total)
            for j, i in enumerate(instances)
        }

    def held(self, instance: int, tier: int) -> set[HeldKey]:
        """The (group, engine hash) pairs the instance holds in ``tier`` (for checks)."""
        held = self._held.get(instance)
        if held is None:
            return set()
        return {k if isinstance(k, tuple) else (0, k) for k in held[tier]}

    def keys(self) -> Iterator[int]:
        """Every block key some instance holds in some tier."""
        return iter(self._refs)

    def num_blocks(self, instance: int | None = None) -> int:
        """Indexed engine blocks (of one instance, or in all)."""
        if instance is not None:
            held = self._held.get(instance)
            return 0 if held is None else sum(len(t) for t in held)
        return sum(len(t) for held in self._held.values() for t in held)

    def num_keys(self) -> int:
        return len(self._refs)


_EMPTY: dict[int, int] = {}


def _decrement(table: dict[int, int], key: int) -> None:
    left = table.get(key, 0) - 1
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)
