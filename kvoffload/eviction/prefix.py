"""Prefix-aware eviction: learned hit density per class and age, leaf-first, with admission."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Sequence

from kvoffload.eviction.base import HeldBlocksPolicy, OffloadedBlock, register_eviction_policy
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = ["PrefixPolicy"]

_GROUP_BYTES = 4  # the KV-cache group suffix of an OffloadKey (see kvoffload.keys)

# Use-count buckets: 1, 2, 3, 4, 5-6, 7-9, 10-15, 16+ (index 0 unused: a counted key has count >= 1).
_COUNT_BUCKET = (0, 0, 1, 2, 3, 4, 4, 5, 5, 5, 6, 6, 6, 6, 6, 6)
_TOP_BUCKET = 7
_NOTHING_EVICTABLE = float("inf")
# Sampling draws from a 64-bit LCG whose whole state is one int, so that a failed evict() can
# leave it untouched (atomicity covers the order of future evictions too).
_LCG_MUL = 6364136223846793005
_LCG_INC = 1442695040888963407
_MASK64 = (1 << 64) - 1
# Blocks idle longer than the age buckets reach score just below 0, the oldest lowest.
_BEYOND_HISTORY = 1e-30
#: Classes: count bucket x (last block of its request's chain or not).
NUM_CLASSES = (_TOP_BUCKET + 1) * 2


def block_class(count: int, chain_tail: bool) -> int:
    """The class of a key used by ``count`` requests, the last used as the end of its chain."""
    return (_COUNT_BUCKET[count] if count < len(_COUNT_BUCKET) else _TOP_BUCKET) * 2 + chain_tail


class _Entry:
    """What the policy knows about one key, held or only remembered. Mutated by the policy only."""

    __slots__ = (
        "block",
        "children",
        "cls",
        "count",
        "key",
        "leaf_pos",
        "parent",
        "parent_key",
        "pinned",
        "req",
        "stamp",
    )

    def __init__(self, key: OffloadKey, stamp: int) -> None:
        self.key = key
        self.block: OffloadedBlock | None = None  # set iff the tier holds the key
        self.count = 0  # distinct requests that used the key (while remembered)
        self.stamp = stamp  # clock of the last counted use
        self.cls = 0  # block_class() at the last counted use
        self.req = -1  # serial of the last request that counted it
        self.parent_key: OffloadKey | None = None  # the key before it in its chain, once seen
        self.parent: _Entry | None = None  # while held: the parent's entry as of insert
        self.children = 0  # held entries whose ``parent`` is this entry
        self.leaf_pos = -1  # index in the leaf list while a held, unpinned leaf, else -1
        self.pinned = False  # held under an operator pin: off the leaf list, never a victim


@register_eviction_policy
class PrefixPolicy(HeldBlocksPolicy):
    """Evict the held *leaf* with the lowest learned hit density; admit only what beats it.

    **What it knows that a generic cache doesn't.** Keys arrive in prefix order, so each key's
    chain parent is known; a block is a hit only if its whole prefix is held, so only *leaves*
    (held blocks with no held successor) are evicted, and a chain is stored only as far as its
    prefix will be held. The last block of a request's chain (often partial, rarely reused until
    a later request extends it) and a key's use count (distinct requests, counted once per
    request through the ``ReqContext``) form its *class*: ``block_class(count, chain_tail)``.

    **Hit density (learned, LHD-style).** Every key seen, held or not, is remembered in a history
    of at most ``history_size`` non-held keys (LRU order). When a remembered key is used again at
    idle age ``a`` (clock ticks: one per key counted per request) its previous class scores a
    *hit* at ``a``; a key that drops out of the history unused scores an *expiry* at its age.
    Every ``recompute_every`` ticks, per class ``c`` and age bucket ``a``::

        density[c][a] = sum(hits[c][x], x >= a) / sum((x - a + 1) * events[c][x], x >= a)

    (events = hits + expiries), then all counts decay by ``decay``. That is the expected number
    of future hits per unit of cache space-time of a block of class ``c`` idle for ``a``. A block
    idle beyond the last bucket scores just below 0 (the longer idle, the lower: LRU among the
    forgotten); a block whose parent is no longer held scores -1 (it can never be hit).

    **Eviction rule.** ``evict(n, protected)`` repeats ``n`` times: draw ``samples`` entries
    (seeded 64-bit LCG, so runs are reproducible) from the evictable leaves (``ref_cnt == 0``, not protected, not already chosen;
    a parent all of whose held children were chosen in this call counts as a leaf) and choose
    the one with the lowest density. If sampling finds too few, it scans leaves, then every held
    block. Atomic: exactly ``n`` victims, or ``None`` and nothing changed.

    **Operator pins** (:meth:`pinned` / :meth:`unpinned`): a pinned block leaves the leaf list
    (no sample draws it) and is never promoted to a leaf while pinned; it is a leaf again, at
    once, when unpinned with no held child. O(1) per key.

    **Admission rule.** ``admit`` stores the absent keys in chain order while they fit in free
    slots; beyond that, a key is admitted only if its class's density at age 0 is at least the
    lowest density among ``samples`` sampled evictable leaves (what it would displace), and the
    first key refused ends the admission (its successors would be unreachable). A key whose chain
    parent is known, not held and not admitted just before it is refused as soon as slots run out.
    A small tier therefore refuses first-seen blocks and keeps the heads of reused prefixes; a
    large one, whose evicted leaves are worth little, admits nearly everything: the threshold
    adapts by itself.

    Costs: ``touch``/``admit`` O(keys in the call); ``evict`` O(n * samples) (the fallback scan,
    when nearly every leaf is being read or protected, is O(held)); a recompute is
    O(classes * ages) every ``recompute_every >= classes * ages`` ticks. Memory: one small record
    per held block plus ``history_size`` remembered keys.
    """

    name = "prefix"

    def __init__(
        self,
        capacity: int,
        *,
        history_size: int | None = None,
        samples: int = 32,
        num_ages: int = 256,
        decay: float = 0.9,
        seed: int = 0,
    ) -> None:
        super().__init__(capacity)
        self._held: dict[OffloadKey, _Entry] = {}  # same keys as _blocks
        self._history: OrderedDict[OffloadKey, _Entry] = OrderedDict()  # not held; oldest use first
        # Measured on the conversation trace (docs/eviction-policies.md): remembering 3/4 as
        # many keys as the tier holds, at least 24K, beats remembering 16x as many: use counts
        # then forget prefixes idle for longer than the tier could have kept them.
        self.history_size = (
            history_size if history_size is not None else max(3 * capacity // 4, 24_576)
        )
        self._leaves: list[_Entry] = []
        self._samples = samples
        self._rng = seed & _MASK64
        self._num_ages = num_ages
        # Age bucket width: a power of two such that the buckets span about twice as many
        # ticks as the history holds keys.
        self._shift = max(0, (2 * self.history_size // num_ages).bit_length() - 1)
        self._hits = [[0.0] * num_ages for _ in range(NUM_CLASSES)]
        self._expiries = [[0.0] * num_ages for _ in range(NUM_CLASSES)]
        self._density = [[0.0] * num_ages for _ in range(NUM_CLASSES)]
        self._decay = decay
        self.recompute_every = max(4096, NUM_CLASSES * num_ages)
        self._next_recompute = self.recompute_every
        self._clock = 0

    # -- learning --------------------------------------------------------------------------------

    def _record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Count one use per key per request, learn reuse ages, remember chain parents."""
        serial = ctx.serial
        held, history, hits = self._held, self._history, self._hits
        shift, last_age = self._shift, self._num_ages - 1
        clock = self._clock
        n = len(keys)
        prev: OffloadKey | None = None
        prev_group = b""
        for i in range(n):
            key = keys[i]
            group = key[-_GROUP_BYTES:]
            e = held.get(key)
            if e is None:
                e = history.get(key)
                if e is None:
                    e = history[key] = _Entry(key, clock)
                else:
                    history.move_to_end(key)
            if e.req != serial:
                e.req = serial
                clock += 1
                count = e.count
                if count:
                    age = (clock - e.stamp) >> shift
                    hits[e.cls][age if age < last_age else last_age] += 1.0
                e.count = count = count + 1
                e.stamp = clock
                tail = i + 1 == n or keys[i + 1][-_GROUP_BYTES:] != group
                e.cls = block_class(count, tail)
            if e.parent_key is None and prev is not None and group == prev_group and prev != key:
                e.parent_key = prev
            prev, prev_group = key, group
        self._clock = clock
        self._trim_history()
        if clock >= self._next_recompute:
            self._recompute()

    def _trim_history(self) -> None:
        history = self._history
        excess = len(history) - self.history_size
        if excess <= 0:
            return
        expiries, clock, shift, last_age = (
            self._expiries,
            self._clock,
            self._shift,
            self._num_ages - 1,
        )
        for _ in range(excess):
            e = history.popitem(last=False)[1]
            if e.count:
                age = (clock - e.stamp) >> shift
                expiries[e.cls][age if age < last_age else last_age] += 1.0

    def _recompute(self) -> None:
        decay = self._decay
        for hits, expiries, density in zip(self._hits, self._expiries, self._density, strict=True):
            future_hits = events = lifetime = 0.0
            for age in range(self._num_ages - 1, -1, -1):
                future_hits += hits[age]
                events += hits[age] + expiries[age]
                lifetime += events
                density[age] = future_hits / lifetime if lifetime else 0.0
                hits[age] *= decay
                expiries[age] *= decay
        self._next_recompute = self._clock + self.recompute_every

    def density(self, key: OffloadKey) -> float:
        """The current hit density of held ``key`` (-1 when its prefix is gone). For tools and tests."""
        return self._density_of(self._held[key])

    def _density_of(self, e: _Entry) -> float:
        parent = e.parent
        if parent is not None and parent.block is None:
            return -1.0
        idle = self._clock - e.stamp
        age = idle >> self._shift
        if age >= self._num_ages - 1:
            return -idle * _BEYOND_HISTORY
        return self._density[e.cls][age]

    # -- the policy interface ------------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Count a use of every key, held or not: unknown keys change no held block."""
        if keys:
            self._record(keys, ctx)

    def admit(
        self, keys: list[OffloadKey], chain: Sequence[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey]:
        self._record(chain, ctx)
        held, history = self._held, self._history
        room = self.capacity - len(self._blocks)
        if len(keys) <= room:
            return keys
        bar = self._sample_bar(set(chain))
        if bar == _NOTHING_EVICTABLE:
            return keys  # let evict() find room or report that there is none
        density0 = self._density
        admitted: list[OffloadKey] = []
        for key in keys:
            e = held.get(key) or history.get(key)
            if e is None:
                break  # forgotten already (a chain longer than the history)
            if len(admitted) >= room:
                pk = e.parent_key
                if pk is not None and pk not in held and (not admitted or admitted[-1] != pk):
                    break  # its prefix will not be held
                if density0[e.cls][0] < bar:
                    break  # worth less than what it would displace, and so are its successors
            admitted.append(key)
        return admitted

    def _sample_bar(self, protected: Container[OffloadKey]) -> float:
        """The lowest density among sampled evictable leaves: what a store would displace."""
        leaves = self._leaves
        bar = _NOTHING_EVICTABLE
        if not leaves:
            return bar
        rng, size, density_of = self._rng, len(leaves), self._density_of
        for _ in range(self._samples):
            rng = (rng * _LCG_MUL + _LCG_INC) & _MASK64
            e = leaves[((rng >> 32) * size) >> 32]
            # Leaves (and promoted parents, and _held's entries) are held: block is not None.
            if e.block.ref_cnt == 0 and e.key not in protected:  # type: ignore[union-attr]
                d = density_of(e)
                if d < bar:
                    bar = d
        self._rng = rng
        return bar

    def pinned(self, keys: Sequence[OffloadKey]) -> None:
        held = self._held
        for key in keys:
            e = held.get(key)
            if e is None or e.pinned:
                continue
            e.pinned = True
            if e.leaf_pos >= 0:
                self._unleaf(e)

    def unpinned(self, keys: Sequence[OffloadKey]) -> None:
        held, leaves = self._held, self._leaves
        for key in keys:
            e = held.get(key)
            if e is None or not e.pinned:
                continue
            e.pinned = False
            if e.children == 0:
                e.leaf_pos = len(leaves)
                leaves.append(e)

    def insert(self, key: OffloadKey, block: OffloadedBlock, ctx: ReqContext | None = None) -> None:
        e = self._history.pop(key, None)
        if e is None:
            e = _Entry(key, self._clock)
        e.block = block
        self._held[key] = e
        self._blocks[key] = block
        pk = e.parent_key
        parent = None if pk is None else (self._held.get(pk) or self._history.get(pk))
        e.parent = parent
        if parent is not None:
            parent.children += 1
            if parent.leaf_pos >= 0:
                self._unleaf(parent)
        if e.children == 0:
            e.leaf_pos = len(self._leaves)
            self._leaves.append(e)

    def _unleaf(self, e: _Entry) -> None:
        leaves = self._leaves
        last = leaves.pop()
        if last is not e:
            leaves[e.leaf_pos] = last
            last.leaf_pos = e.leaf_pos
        e.leaf_pos = -1

    def _drop(self, e: _Entry) -> None:
        """Stop holding ``e``; remember it in the history."""
        del self._held[e.key]
        del self._blocks[e.key]
        e.block = None
        e.pinned = False
        if e.leaf_pos >= 0:
            self._unleaf(e)
        parent = e.parent
        if parent is not None:
            e.parent = None
            parent.children -= 1
            if parent.children == 0 and parent.block is not None and not parent.pinned:
                parent.leaf_pos = len(self._leaves)
                self._leaves.append(parent)
        self._history[e.key] = e

    def remove(self, key: OffloadKey) -> None:
        self._drop(self._held[key])
        self._trim_history()

    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        if n <= 0:
            return []
        leaves, samples, rng = self._leaves, self._samples, self._rng
        # _density_of() inlined: this loop runs `samples` times per victim (measured hot spot).
        density, clock, shift, oldest = self._density, self._clock, self._shift, self._num_ages - 1
        chosen: dict[_Entry, None] = {}  # insertion-ordered: children before their parents
        promoted: list[_Entry] = []  # parents that became leaves within this call
        chosen_children: dict[_Entry, int] = {}
        n_leaves = len(leaves)
        while len(chosen) < n:
            size = n_leaves + len(promoted)
            best: _Entry | None = None
            best_d = _NOTHING_EVICTABLE
            for _ in range(samples if size else 0):
                rng = (rng * _LCG_MUL + _LCG_INC) & _MASK64
                i = ((rng >> 32) * size) >> 32
                e = leaves[i] if i < n_leaves else promoted[i - n_leaves]
                # A leaf or a promoted (held) parent: block is not None.
                if e.block.ref_cnt != 0 or e in chosen or e.key in protected:  # type: ignore[union-attr]
                    continue
                parent = e.parent
                if parent is not None and parent.block is None:
                    d = -1.0
                else:
                    idle = clock - e.stamp
                    age = idle >> shift
                    d = -idle * _BEYOND_HISTORY if age >= oldest else density[e.cls][age]
                if d < best_d:
                    best, best_d = e, d
            if best is None:
                break
            chosen[best] = None
            parent = best.parent
            if parent is not None and parent.block is not None and not parent.pinned:
                done = chosen_children.get(parent, 0) + 1
                chosen_children[parent] = done
                if done == parent.children:
                    promoted.append(parent)
        if len(chosen) < n:
            # Sampling found too few (nearly every leaf being read or protected): scan, leaves first.
            for e in itertools.chain(leaves, promoted, self._held.values()):  # all held
                if e.block.ref_cnt == 0 and e not in chosen and e.key not in protected:  # type: ignore[union-attr]
                    chosen[e] = None
                    if len(chosen) == n:
                        break
            else:
                return None
        self._rng = rng
        # Chosen entries are held: block is not None.
        victims: list[tuple[OffloadKey, OffloadedBlock]] = [(e.key, e.block) for e in chosen]  # type: ignore[misc]
        for e in chosen:
            self._drop(e)
        self._trim_history()
        return victims

    def clear(self) -> None:
        self._blocks.clear()
        self._held.clear()
        self._history.clear()
        self._leaves.clear()
        self.generation += 1

    def check_invariants(self) -> None:
        assert self._blocks.keys() == self._held.keys(), "get() and the held records disagree"
        assert len(self._history) <= self.history_size, "history over its bound"
        children: dict[_Entry, int] = {}
        for key, e in self._held.items():
            assert e.key == key and e.block is self._blocks[key], f"{key.hex()}: stale record"
            assert key not in self._history, f"{key.hex()}: both held and in the history"
            if e.parent is not None:
                children[e.parent] = children.get(e.parent, 0) + 1
        for e in itertools.chain(self._held.values(), self._history.values(), children):
            assert e.children == children.get(e, 0), f"{e.key.hex()}: children {e.children}"
        for key, e in self._history.items():
            assert e.key == key and e.block is None, f"{key.hex()}: history record holds a block"
            assert e.leaf_pos == -1, f"{key.hex()}: a remembered key is on the leaf list"
        for pos, e in enumerate(self._leaves):
            assert e.leaf_pos == pos and e.block is not None and e.children == 0, (
                f"leaf {pos} is stale"
            )
        n_leaves = sum(1 for e in self._held.values() if e.children == 0 and not e.pinned)
        assert n_leaves == len(self._leaves), "an unpinned block with no held child is not a leaf"
        for e in self._history.values():
            assert not e.pinned, f"{e.key.hex()}: a remembered key is pinned"
