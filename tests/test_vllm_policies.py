"""Our eviction policies inside vLLM 0.33's own ``CPUOffloadingManager`` (no GPU).

vLLM's manager loads each ``KVOffload*`` class the way ``--kv-transfer-config`` does
(``cache_policy`` + ``cache_policy_module_path``). Random operation streams (hypothesis) check
what vLLM's LRU and ARC guarantee, on vLLM's policies and ours alike: no pinned (being loaded)
or pending (being stored) chunk is ever evicted, the pool never holds more than its capacity,
evicted keys are gone, a failed store frees its chunk. A generated trace shows our gain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_cases import as_vllm_keys, require_vllm, vllm_keys

require_vllm()

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvoffload.benchmark import traces  # noqa: E402
from kvoffload.benchmark.hit_rate import block_keys  # noqa: E402
from kvoffload.eviction import LRUPolicy  # noqa: E402
from kvoffload.integrations.vllm.policies import KVOffloadCachePolicy  # noqa: E402
from kvoffload.integrations.vllm.replay import POLICY_MODULE, hit_ratio  # noqa: E402

CAPACITY = 6
UNIVERSE = vllm_keys(16)
VLLM_POLICIES: list[tuple[str, str | None]] = [("lru", None), ("arc", None)]
OUR_POLICIES: list[tuple[str, str | None]] = [
    (name, POLICY_MODULE)
    for name in (
        "KVOffloadLRU",
        "KVOffloadARC",
        "KVOffloadS3FIFO",
        "KVOffloadPrefix",
        "KVOffloadAdaptive",
    )
]

key_runs = st.lists(st.integers(0, len(UNIVERSE) - 1), min_size=1, max_size=5, unique=True)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("store"), key_runs),
        st.tuples(st.just("load"), key_runs),
        st.tuples(st.just("complete_store"), st.booleans()),
        st.tuples(st.just("complete_load"), st.just(None)),
    ),
    max_size=40,
)


class OpStream:
    """vLLM's CPU manager under a stream of requests, with a model of pins and pending stores."""

    def __init__(self, policy: str, module: str | None) -> None:
        self.manager = CPUOffloadingManager(
            num_chunks=CAPACITY, cache_policy=policy, cache_policy_module_path=module
        )
        self.pending: list[tuple[ReqContext, list[OffloadKey]]] = []  # prepared, not completed
        self.pinned: list[tuple[ReqContext, list[OffloadKey]]] = []  # loading, not completed
        self._n = 0

    def request(self, keys: list[OffloadKey]) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"r{self._n}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, 16 * (i + 1))
        self.manager.on_new_request(ctx)
        return ctx

    def apply(self, op: str, arg: object) -> None:
        m = self.manager
        if op == "store":
            keys = [UNIVERSE[i] for i in arg]  # type: ignore[attr-defined]
            ctx = self.request(keys)
            out = m.prepare_store(keys, ctx)
            if out is not None:
                held = self.held_keys()
                for key in out.evicted_keys:
                    assert key not in held, "an evicted key is still held"
                if out.keys_to_store:
                    self.pending.append((ctx, list(out.keys_to_store)))
            m.on_request_finished(ctx)  # vLLM may complete transfers after this
        elif op == "load":
            keys = [UNIVERSE[i] for i in arg]  # type: ignore[attr-defined]
            ctx = self.request(keys)
            hits = []
            for key in keys:
                if m.lookup(key, ctx) is not LookupResult.HIT:
                    break
                hits.append(key)
            if hits:
                m.prepare_load(hits, ctx)
                self.pinned.append((ctx, hits))
            m.on_request_finished(ctx)
        elif op == "complete_store" and self.pending:
            ctx, keys = self.pending.pop(0)
            m.complete_store(keys, ctx, success=bool(arg))
        elif op == "complete_load" and self.pinned:
            ctx, keys = self.pinned.pop(0)
            m.complete_load(keys, ctx)

    def held_keys(self) -> set[OffloadKey]:
        return {
            k
            for k in UNIVERSE
            if self.manager.lookup(k, ReqContext("probe")) is not LookupResult.MISS
        }

    def check(self) -> None:
        held = self.held_keys()
        assert len(held) <= CAPACITY, "the pool holds more chunks than its capacity"
        pins = Counter(k for _, keys in self.pinned for k in keys)
        probe = ReqContext("probe")
        for key in pins:
            assert self.manager.lookup(key, probe) is LookupResult.HIT, "a pinned chunk left"
        for _, keys in self.pending:
            for key in keys:
                assert self.manager.lookup(key, probe) is LookupResult.HIT_PENDING
        policy = self.manager._policy
        if isinstance(policy, KVOffloadCachePolicy):
            policy.check_invariants()


@pytest.mark.parametrize(("policy", "module"), VLLM_POLICIES + OUR_POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations)
def test_op_streams_keep_pins_and_capacity(policy: str, module: str | None, ops: list) -> None:
    stream = OpStream(policy, module)
    for op, arg in ops:
        stream.apply(op, arg)
        stream.check()
    while stream.pending:  # every chunk eventually readable or freed
        stream.apply("complete_store", True)
        stream.check()
    while stream.pinned:
        stream.apply("complete_load", None)
        stream.check()


def test_full_pool_of_pinned_chunks_refuses_a_store() -> None:
    stream = OpStream("KVOffloadPrefix", POLICY_MODULE)
    stream.apply("store", list(range(CAPACITY)))
    stream.apply("complete_store", True)
    stream.apply("load", list(range(CAPACITY)))  # every chunk pinned
    ctx = stream.request(UNIVERSE[CAPACITY : CAPACITY + 1])
    assert stream.manager.prepare_store(UNIVERSE[CAPACITY : CAPACITY + 1], ctx) is None
    stream.check()


class AdmitReusedLRU(LRUPolicy):
    """LRU that admits a key only once an earlier request offered it (a real admission rule,
    simple enough that the test knows what it declines)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.offered: set[bytes] = set()

    def admit(self, keys: list, chain: Sequence, ctx: object) -> list:
        admitted = [k for k in keys if k in self.offered]
        self.offered.update(chain)
        return admitted


class AdmitReusedCachePolicy(KVOffloadCachePolicy):
    def make_policy(self, capacity: int) -> AdmitReusedLRU:
        return AdmitReusedLRU(capacity)  # not registered: the registry stays as shipped


def test_declined_chunks_are_stored_on_probation_and_evicted_first() -> None:
    stream = OpStream("AdmitReusedCachePolicy", __name__)
    policy = stream.manager._policy
    assert isinstance(policy, AdmitReusedCachePolicy)
    hot = [0, 1, 2]
    stream.apply("store", hot)  # first offer: declined, but vLLM stores them: on probation
    stream.apply("complete_store", True)
    assert policy.num_on_probation == 3
    stream.apply("load", hot)  # a later request uses them: admitted
    stream.apply("complete_load", None)
    assert policy.num_on_probation == 0
    for start in range(3, 15, 3):  # one-off blocks fill the rest of the pool, again and again
        stream.apply("store", [start, start + 1, start + 2])
        stream.apply("complete_store", True)
        stream.check()
        assert policy.num_on_probation == 3  # each batch displaced the previous one only
    held = stream.held_keys()
    assert all(UNIVERSE[i] in held for i in hot), "the reused blocks were kept"


def test_probation_chunks_being_loaded_are_not_evicted() -> None:
    stream = OpStream("AdmitReusedCachePolicy", __name__)
    stream.apply("store", [0, 1, 2, 3, 4, 5])  # all on probation, the pool full
    stream.apply("complete_store", True)
    ctx = stream.request([UNIVERSE[0]])
    stream.manager.prepare_load([UNIVERSE[0]], ctx)  # pinned (admission waits for the finish)
    stream.pinned.append((ctx, [UNIVERSE[0]]))
    stream.apply("store", [6, 7, 8, 9, 10])
    stream.check()
    stream.apply("store", [11])  # only the pinned chunk would be left to evict: refused
    stream.check()


def test_our_policies_beat_vllm_lru_on_a_multi_tenant_trace() -> None:
    requests = [r["hash_ids"] for r in traces.generate("tenants", num_requests=1500)]
    keys = as_vllm_keys(block_keys(requests))
    capacity = len(keys) // 20
    vllm_lru = hit_ratio(requests, keys, "lru", capacity)
    prefix = hit_ratio(requests, keys, "KVOffloadPrefix", capacity, POLICY_MODULE)
    s3fifo = hit_ratio(requests, keys, "KVOffloadS3FIFO", capacity, POLICY_MODULE)
    adaptive = hit_ratio(requests, keys, "KVOffloadAdaptive", capacity, POLICY_MODULE)
    assert prefix > 1.2 * vllm_lru, (prefix, vllm_lru)
    assert s3fifo > 1.2 * vllm_lru, (s3fifo, vllm_lru)
    assert adaptive > 1.2 * vllm_lru, (adaptive, vllm_lru)
    # Our LRU inside vLLM evicts in vLLM's LRU order: the same figure.
    assert hit_ratio(requests, keys, "KVOffloadLRU", capacity, POLICY_MODULE) == pytest.approx(
        vllm_lru
    )
