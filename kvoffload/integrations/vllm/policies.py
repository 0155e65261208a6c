"""Our eviction policies as vLLM ``CachePolicy`` classes for its CPU tier (0.32 and 0.33).

Load one with ``kv_connector_extra_config = {"eviction_policy": "KVOffloadPrefix",
"cache_policy_module_path": "kvoffload.integrations.vllm.policies", ...}`` (for
``CPUOffloadingSpec`` and as the primary tier's policy of ``TieringOffloadingSpec``).

How vLLM's ``CPUOffloadingManager`` drives a policy, and what the adapter makes of it:

* It stores vLLM ``ChunkStatus`` records (``ref_cnt``, ``chunk_id``) in the policy; our
  policies read only ``ref_cnt`` (-1 pending, 0 evictable, n pinned), so the records are held
  as they are and eviction honours vLLM's pins by the same rule as in kvoffload.
* vLLM's scheduler never calls ``touch``; uses arrive as ``on_request_access`` (keys first
  seen by a request: its loaded hits, its offered stores), ``on_store_miss`` (absent keys
  about to be inserted) and ``on_request_finished`` (the request's keys per KV-cache group in
  prefix order, which of them it only inserted and which it reused).
* ``KVOffloadLRU`` and ``KVOffloadARC`` take the three as our policies' own request hooks
  (``request_accessed``, ``store_missed``, ``request_finished``), which follow vLLM's: inside
  vLLM's manager they decide exactly as vLLM's ``lru`` and ``arc`` (``tests/test_vllm_parity.py``).
* The other adapters forward the first two as our ``touch`` in prefix order, with the key before
  the new ones so that prefix-aware policies link each key to its parent, and the last as our
  ``request_finished`` (the request's keys per group, the ones it inserted as stored runs) for
  policies that commit, as ``touch`` for the others. Our policies count a use once per request
  (state on our :class:`~kvoffload.manager_contract.ReqContext`, see
  :func:`~kvoffload.integrations.vllm.context.kvoffload_context`), so repeats are harmless.
* vLLM 0.32 (feature-detected) has no ``on_request_access`` and inserts without the request's
  context: a request's chain then grows at ``on_store_miss``, an ``insert`` is attributed to the
  request whose store miss of that key came last (so a declined key goes on probation and a
  policy that commits at finish sees what the request stored), and a use of a key on probation
  admits it at ``on_request_finished`` (its ``reused_keys``).
* vLLM has no admission hook: it inserts every absent key it offers. For a policy with
  admission control (``prefix``) the adapter asks ``admit`` in ``on_store_miss``; a declined
  key is still stored by vLLM but held *on probation*, outside our policy, and evicted before
  any admitted block; a later request that uses it admits it. The effect is kvoffload's
  "don't let a first-seen block displace a valuable one", at the cost of the slot meanwhile.

Invariants (checked by ``tests/integrations/vllm``): a block with ``ref_cnt != 0`` or in
``protected`` is never evicted; ``evict`` returns exactly ``n`` blocks or ``None`` with no
change; every held key is in exactly one of our policy and the probation list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import ClassVar, cast

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.base import ReqContext as VllmReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvoffload.eviction import EvictionPolicy, RequestUses, create_eviction_policy
from kvoffload.eviction.base import overrides
from kvoffload.integrations.vllm.compat import (
    POLICY_HAS_REQUEST_ACCESS,
    as_ours,
    our_key,
    our_keys,
)
from kvoffload.integrations.vllm.context import kvoffload_context
from kvoffload.keys import OffloadKey as KVOKey
from kvoffload.manager_contract import ReqContext

__all__ = [
    "KVOffloadARC",
    "KVOffloadAdaptive",
    "KVOffloadCachePolicy",
    "KVOffloadLRU",
    "KVOffloadPrefix",
    "KVOffloadRequestHooks",
    "KVOffloadS3FIFO",
]


class _RequestChain:
    """One request's keys as one adapter has seen them (prefix order), and its declined keys."""

    __slots__ = ("declined", "keys", "seen")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.seen: set[OffloadKey] = set()
        self.declined: set[OffloadKey] = set()


class _Chains:
    """Per-request state of every adapter, keyed by adapter (two tiers may share a request)."""

    __slots__ = ("by_owner",)

    def __init__(self) -> None:
        self.by_owner: dict[object, _RequestChain] = {}


class KVOffloadCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` ordering chunks by the kvoffload policy named ``policy_name``.

    Subclasses set ``policy_name`` (a name of :func:`kvoffload.eviction.create_eviction_policy`,
    entry-point policies included) or override :meth:`make_policy`. See the module docstring for the mapping of vLLM's hooks.
    """

    policy_name: ClassVar[str]

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._policy = self.make_policy(cache_capacity)
        self._admits = overrides(self._policy, "admit")
        self._commits = overrides(self._policy, "request_finished")
        # Stored by vLLM although our policy declined them: evicted first, oldest first.
        self._probation: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        # vLLM 0.32 inserts without the request's context: each key's last store miss, by whom.
        # An entry leaves at the insert or when that request finishes.
        self._missed_by: dict[OffloadKey, ReqContext] = {}

    def make_policy(self, capacity: int) -> EvictionPolicy:
        """Our policy for a CPU tier of ``capacity`` chunks (default: the registered
        ``policy_name``)."""
        return create_eviction_policy(self.policy_name, capacity)

    @property
    def policy(self) -> EvictionPolicy:
        """The kvoffload policy inside (for tools and tests)."""
        return self._policy

    @property
    def num_on_probation(self) -> int:
        """Chunks held although our policy declined to admit them."""
        return len(self._probation)

    # -- per-request state -----------------------------------------------------------------------

    def _chain(self, ctx: ReqContext) -> _RequestChain:
        chains = ctx.get_state(_Chains)
        if chains is None:
            chains = _Chains()
            ctx.set_state(chains)
        chain = chains.by_owner.get(self)
        if chain is None:
            chain = chains.by_owner[self] = _RequestChain()
        return chain

    def _observe(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """Append the request's new keys to its chain; return them preceded by the key before."""
        chain = self._chain(ctx)
        before = chain.keys[-1:]
        new = [k for k in keys if k not in chain.seen]
        chain.seen.update(new)
        chain.keys.extend(new)
        return before + new

    def _admit_from_probation(self, keys: Iterable[OffloadKey]) -> None:
        """A use of a declined chunk admits it into our policy."""
        probation = self._probation
        for key in keys:
            chunk = probation.pop(key, None)
            if chunk is not None:
                self._policy.insert(key, chunk)  # type: ignore[arg-type]  # by no request

    # -- CachePolicy -----------------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self._policy.get(our_key(key))
        if chunk is None and self._probation:
            return self._probation.get(key)
        return chunk  # type: ignore[return-value]

    def insert(
        self, key: OffloadKey, chunk: ChunkStatus, req_context: VllmReqContext | None = None
    ) -> None:
        if req_context is None:  # vLLM 0.32
            ctx = self._missed_by.pop(key, None)
        else:
            ctx = kvoffload_context(req_context)
        chain = self._chain(ctx) if ctx is not None else None
        if chain is not None and key in chain.declined:
            chain.declined.discard(key)
            self._probation[key] = chunk
        else:
            self._policy.insert(key, chunk, ctx)  # type: ignore[arg-type]

    def remove(self, key: OffloadKey) -> None:
        if self._probation.pop(key, None) is None:
            self._policy.remove(our_key(key))

    def touch(self, keys: Iterable[OffloadKey], req_context: VllmReqContext) -> None:
        keys = list(keys)
        if self._probation:
            self._admit_from_probation(keys)
        self._policy.touch(as_ours(keys), kvoffload_context(req_context))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: VllmReqContext) -> None:
        ctx = kvoffload_context(req_context)
        keys = self._observe(keys, ctx)
        if self._probation:
            self._admit_from_probation(keys)
        self._policy.touch(as_ours(keys), ctx)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: VllmReqContext) -> None:
        ctx = kvoffload_context(req_context)
        misses = list(keys)
        chain = self._chain(ctx)
        if POLICY_HAS_REQUEST_ACCESS:
            context = chain.keys[-1:] + misses
        else:  # vLLM 0.32: no on_request_access, so the chain grows here
            context = self._observe(misses, ctx)
            self._missed_by.update(dict.fromkeys(misses, ctx))
        if not self._admits:
            self._policy.touch(as_ours(context), ctx)
            return
        admitted = set(self._policy.admit(as_ours(misses), as_ours(context), ctx))
        chain.declined.update(k for k in misses if our_key(k) not in admitted)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: VllmReqContext,
    ) -> None:
        ctx = kvoffload_context(req_context)
        touched = [list(keys) for keys in key_groups]
        if self._probation and reused_keys:  # vLLM 0.32 tells a request's uses only here
            self._admit_from_probation(reused_keys)
        if self._commits:
            if not POLICY_HAS_REQUEST_ACCESS:  # vLLM 0.32 tells a request's access only here
                for keys in touched:
                    self._policy.touch(as_ours(keys), ctx)
            uses = RequestUses()
            uses.runs = [
                (as_ours(keys), (), as_ours([k for k in keys if k in insertion_only_keys]))
                for keys in touched
            ]
            self._policy.request_finished(uses, ctx)
        else:
            for keys in touched:
                self._policy.touch(as_ours(keys), ctx)
        chains = ctx.get_state(_Chains)
        chain = chains.by_owner.pop(self, None) if chains is not None else None
        if chain is not None and self._missed_by:  # vLLM 0.32: its misses never inserted
            missed_by = self._missed_by
            for key in chain.keys:
                if missed_by.get(key) is ctx:
                    del missed_by[key]

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        victims: list[tuple[OffloadKey, ChunkStatus]] = []
        for key, chunk in self._probation.items():  # declined chunks first, oldest first
            if chunk.ref_cnt == 0 and key not in protected:
                victims.append((key, chunk))
                if len(victims) == n:
                    break
        on_probation = len(victims)
        if on_probation < n:  # then our policy's order; atomic: nothing has changed yet
            rest = self._policy.evict(n - on_probation, as_ours(protected))
            if rest is None:
                return None
            victims.extend(rest)  # type: ignore[arg-type]  # our policy holds vLLM's ChunkStatus
        for key, _ in victims[:on_probation]:
            del self._probation[key]
        return victims

    def clear(self) -> None:
        self._policy.clear()
        self._probation.clear()
        self._missed_by.clear()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the policy and the probation list overlap (tests only)."""
        assert not any(self._policy.get(our_key(k)) is not None for k in self._probation)
        self._policy.check_invariants()


class KVOffloadRequestHooks(KVOffloadCachePolicy):
    """A kvoffload policy that implements vLLM's request hooks itself (``store_missed``,
    ``request_accessed``, ``request_finished``): each vLLM hook is forwarded as it is."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: VllmReqContext) -> None:
        self._policy.store_missed(our_keys(list(keys)), kvoffload_context(req_context))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: VllmReqContext) -> None:
        self._policy.request_accessed(our_keys(list(keys)), kvoffload_context(req_context))

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: VllmReqContext,
    ) -> None:
        uses = RequestUses()  # one run: vLLM's access, its reuses, its insertions
        everything = as_ours([k for keys in key_groups for k in keys])
        # Sets, as vLLM gives them: the policy only asks them for membership.
        reused = cast("Sequence[KVOKey]", reused_keys)
        inserted = cast("Sequence[KVOKey]", insertion_only_keys)
        uses.runs = [(everything, reused, inserted)]
        self._policy.request_finished(uses, kvoffload_context(req_context))


class KVOffloadLRU(KVOffloadRequestHooks):
    """kvoffload's LRU: vLLM's ``lru``, decision for decision."""

    policy_name = "lru"


class KVOffloadARC(KVOffloadRequestHooks):
    """kvoffload's ARC: vLLM's ``arc``, decision for decision."""

    policy_name = "arc"


class KVOffloadS3FIFO(KVOffloadCachePolicy):
    """kvoffload's S3-FIFO."""

    policy_name = "s3fifo"


class KVOffloadAdaptive(KVOffloadCachePolicy):
    """kvoffload's adaptive policy: S3-FIFO with a learned probation size and a long history."""

    policy_name = "adaptive"


class KVOffloadPrefix(KVOffloadCachePolicy):
    """kvoffload's prefix-aware learned-hit-density policy, with admission on probation."""

    policy_name = "prefix"
