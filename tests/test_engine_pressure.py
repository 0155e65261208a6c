"""Memory pressure, preemption and aborts with offloading on: every request that finishes has the
output of an unconstrained run, an aborted one a prefix of it, and nothing is left behind (no
request, job, held device block, pinned or pending tier block)."""

from __future__ import annotations

import random
from collections.abc import Collection

import pytest
from engine_cases import (
    BLOCK_SIZE,
    assert_outputs_or_aborted_prefix,
    assert_quiescent,
    assert_same_outputs,
    delay_completions,
    drive,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_mix,
    random_tokens,
    reference_outputs,
    run_until_done,
    tiny_engine,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.engine import Engine, RequestOutput, RequestStatus
from kvoffload.errors import ConfigError
from kvoffload.transfer import TransferResult
from kvoffload.worker import CPUCopyHandler, FaultInjectingHandler, OffloadingHandler
from kvoffload.worker.handler import TransferSpec

MAX_STEPS = 5000


def _step_until(engine: Engine, condition, what: str) -> list[RequestOutput]:
    finished: list[RequestOutput] = []
    for _ in range(MAX_STEPS):
        if condition():
            return finished
        finished += engine.step()
    raise AssertionError(f"never reached: {what}")


def _check_partial(out: RequestOutput, ref: RequestOutput) -> None:
    """An aborted request's tokens are the start of what it would have generated."""
    assert out.finish_reason == RequestStatus.FINISHED_ABORTED.value
    assert out.output_token_ids == ref.output_token_ids[: len(out.output_token_ids)]


# ---------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("store_policy", [None, "on_compute", "on_finish", "prompt_only"])
def test_preemption_under_memory_pressure(store_policy: str | None) -> None:
    rng = random.Random(11)
    shared = random_tokens(rng, 3 * BLOCK_SIZE)
    prompts = [(shared if i % 2 else []) + random_tokens(rng, 6 + i) for i in range(10)]
    params = greedy(max_tokens=16)
    want = reference_outputs(prompts, params)
    offload = (
        {}
        if store_policy is None
        else {"kv_offloading_size": host_gib(48), "store_policy": store_policy}
    )
    with tiny_engine(num_device_blocks=20, max_num_seqs=8, **offload) as engine:
        got = engine.generate(prompts, params)
        assert_same_outputs(got, want)
        assert engine.stats()["preemptions"] > 0
        assert sum(o.num_preemptions for o in got) > 0
        assert_quiescent(engine)


@pytest.mark.parametrize(
    ("seed", "num_device_blocks", "host_blocks", "delays"),
    [(17611, 13, 16, (0, 3, 3)), (29984, 13, 18, (0, 0, 0)), (24367, 16, 11, (2, 3, 1))],
)
def test_a_landed_load_is_not_the_preemption_victim(
    seed: int, num_device_blocks: int, host_blocks: int, delays: tuple[int, ...]
) -> None:
    """Pressured runs in which loads land (deterministically late) while blocks are short: a
    request whose load just landed is preempted only when every other candidate's also did, which
    never happens here (these workloads threw 1-4 landed loads away when it was the first victim).
    """
    prompts, params = random_mix(seed, num_prompts=16)
    with tiny_engine(
        num_device_blocks=num_device_blocks,
        max_num_seqs=4,
        kv_offloading_size=host_gib(host_blocks),
        eviction_policy="lru",  # the workloads were found with LRU's hits: another policy's loads
        # land elsewhere, and one may leave only just-loaded candidates (a legitimate preemption)
    ) as engine:
        delay_completions(engine, lambda job_id: delays[job_id % len(delays)])
        ids, done = drive(engine, prompts, params, {})
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["offload_load_jobs"] > 0
        assert stats["preempted_after_load"] == 0
        assert_quiescent(engine)
    assert_same_outputs([done[i] for i in ids], reference_outputs(prompts, params))


def test_requests_nearly_filling_the_device_cache() -> None:
    """Requests of up to the whole device cache (16 blocks = 64 tokens), sharing a prefix,
    submitted together: they preempt one another, reload the prefix and all finish."""
    rng = random.Random(5)
    capacity = 16 * BLOCK_SIZE
    shared = random_tokens(rng, 10 * BLOCK_SIZE)
    # Shared-prefix prompts alternate with unrelated ones that push the prefix out of the device.
    lengths = [
        capacity - 6,
        capacity - 8,
        capacity - 7,
        capacity - 10,
        capacity - 6,
        20,
        capacity - 9,
    ]
    prompts = [
        shared + random_tokens(rng, n - len(shared)) if i % 2 == 0 else random_tokens(rng, n)
        for i, n in enumerate(lengths)
    ]
    params = greedy(max_tokens=6)
    want = reference_outputs(prompts, params)
    with tiny_engine(
        num_device_blocks=16,
        max_num_seqs=4,
        kv_offloading_size=host_gib(64),
        scheduling_policy="fcfs",  # arrival order: the unrelated prompts push the prefix out
    ) as engine:
        got = engine.generate(prompts, params)
        assert_same_outputs(got, want)
        assert engine.stats()["offload_loaded_blocks"] > 0
        assert_quiescent(engine)


def test_too_long_prompt_is_refused_at_add_request() -> None:
    with tiny_engine(num_device_blocks=8, kv_offloading_size=host_gib(16)) as engine:
        capacity = 8 * BLOCK_SIZE
        rng = random.Random(0)
        with pytest.raises(ConfigError, match="prompt") as err:
            engine.add_request(random_tokens(rng, capacity + 1), greedy(1))
        assert "device KV cache" in str(err.value)
        with pytest.raises(ConfigError, match="device KV cache"):  # fits, but not with its output
            engine.add_request(random_tokens(rng, capacity - 2), greedy(3))
        assert not engine.has_unfinished()
        exact = engine.add_request(random_tokens(rng, capacity - 2), greedy(2))
        assert run_until_done(engine, [exact])[exact].finish_reason == "length"
        assert_quiescent(engine)


# ---------------------------------------------------------------------------- aborts


class GatedLoads(OffloadingHandler):
    """A real copy handler (its own, so nobody else collects its results) whose results are
    withheld until :meth:`release`: its loads stay in flight for as long as a test needs."""

    def __init__(self, engine: Engine) -> None:
        assert engine.worker is not None
        self.inner = CPUCopyHandler(engine.worker.layout, engine.worker.host_pool, num_threads=1)
        self.released = False
        self.jobs: list[int] = []

    def release(self) -> None:
        self.released = True

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        self.jobs.append(job_id)
        return self.inner.transfer_async(job_id, spec)

    def get_finished(self) -> list[TransferResult]:
        return self.inner.get_finished() if self.released else []

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        self.inner.wait(job_ids, timeout)

    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        return self.inner.shutdown(timeout)


def _offload_prefix(engine: Engine, rng: random.Random, prefix: list[int]) -> None:
    """Compute ``prefix`` once, then push it out of the device cache (it stays in the host tier)."""
    engine.generate([prefix + random_tokens(rng, 2)], greedy(2))
    engine.drain()
    for _ in range(3):
        engine.generate([random_tokens(rng, len(prefix) + 2)], greedy(2))
        engine.drain()
    hashes = engine.hasher.hash_blocks(prefix)
    assert engine.pool.find_cached_prefix(hashes, len(hashes)) == []


def test_abort_while_waiting() -> None:
    rng = random.Random(1)
    prompts = [random_tokens(rng, 14), random_tokens(rng, 9)]
    want = reference_outputs(prompts, greedy(8))
    with tiny_engine(
        num_device_blocks=32, max_num_seqs=1, kv_offloading_size=host_gib(16)
    ) as engine:
        first = engine.add_request(prompts[0], greedy(8))
        second = engine.add_request(prompts[1], greedy(8))
        engine.step()
        assert [r.request_id for r in engine.scheduler.waiting] == [second]
        engine.abort(second)
        engine.abort(second)  # twice: no-op
        engine.abort("no-such-request")
        done = run_until_done(engine, [first, second])
        assert done[second].output_token_ids == [] and done[second].finish_reason == "abort"
        assert_same_outputs([done[first]], want[:1])
        assert_quiescent(engine)


def test_abort_while_loading_keeps_blocks_until_the_load_is_done() -> None:
    rng = random.Random(2)
    prefix = random_tokens(rng, 6 * BLOCK_SIZE)
    with tiny_engine(num_device_blocks=12, kv_offloading_size=host_gib(32)) as engine:
        _offload_prefix(engine, rng, prefix)
        assert engine.worker is not None
        gate = GatedLoads(engine)
        engine.worker.offloading_worker.register_handler("CPU", "GPU", gate, replace=True)

        loading = engine.add_request(prefix + random_tokens(rng, 3), greedy(4))
        engine.step()
        assert loading in engine.scheduler.loading and gate.jobs  # its load is in flight
        req = engine.scheduler.loading[loading]
        blocks = list(engine.scheduler.blocks_of(req))
        engine.abort(loading)
        assert loading in engine.scheduler.held
        # Another request runs under pressure meanwhile; the aborted load's blocks are never reused.
        other_prompt = random_tokens(rng, 10)
        other = engine.add_request(other_prompt, greedy(6))
        done = run_until_done(engine, [loading, other])
        assert done[loading].finish_reason == "abort" and done[loading].output_token_ids == []
        assert loading in engine.scheduler.held
        assert all(b.ref_cnt == 1 for b in blocks)
        assert engine.connector is not None and engine.connector.has_pending_jobs()

        gate.release()
        assert_quiescent(engine)
        assert engine.stats()["offload_failed_loads"] == 0
    assert_same_outputs([done[other]], reference_outputs([other_prompt], greedy(6)))


def test_abort_while_its_load_fails() -> None:
    """The load fails after the abort: the blocks are freed once the failure is reported, and no
    failed load is handed to the (finished) request."""
    rng = random.Random(4)
    prefix = random_tokens(rng, 6 * BLOCK_SIZE)
    with tiny_engine(num_device_blocks=12, kv_offloading_size=host_gib(32)) as engine:
        _offload_prefix(engine, rng, prefix)
        assert engine.worker is not None
        router = engine.worker.offloading_worker
        failing = FaultInjectingHandler(router.handler("CPU", "GPU"), lambda job_id: True)
        router.register_handler("CPU", "GPU", failing, replace=True)
        loading = engine.add_request(prefix + random_tokens(rng, 3), greedy(4))
        engine.step()
        assert loading in engine.scheduler.loading and failing.injected
        engine.abort(loading)
        assert loading in engine.scheduler.held
        (out,) = engine.step()
        assert out.request_id == loading and out.finish_reason == "abort"
        assert_quiescent(engine)
        assert engine.stats()["offload_failed_loads"] == 1


@pytest.mark.parametrize("store_policy", ["on_compute", "on_finish"])
def test_abort_while_running(store_policy: str) -> None:
    rng = random.Random(3)
    prompts = [random_tokens(rng, 17), random_tokens(rng, 11)]
    want = reference_outputs(prompts, greedy(12))
    with tiny_engine(
        num_device_blocks=16, kv_offloading_size=host_gib(16), store_policy=store_policy
    ) as engine:
        victim = engine.add_request(prompts[0], greedy(12))
        other = engine.add_request(prompts[1], greedy(12))
        finished = _step_until(
            engine,
            lambda: any(
                r.request_id == victim and len(r.output_token_ids) >= 3
                for r in engine.scheduler.running
            ),
            "three tokens generated",
        )
        assert not finished
        engine.abort(victim)
        done = run_until_done(engine, [victim, other])
        _check_partial(done[victim], want[0])
        assert len(done[victim].output_token_ids) >= 3
        assert_same_outputs([done[other]], want[1:])
        assert_quiescent(engine)


# ---------------------------------------------------------------------------- random mixes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    num_device_blocks=st.integers(12, 24),
    max_num_seqs=st.integers(1, 6),
    store_policy=st.sampled_from(["on_compute", "on_finish", "prompt_only"]),
    aborts=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 60)), max_size=4),
    delays=st.lists(st.integers(0, 4), min_size=1, max_size=5),
)
def test_random_mix_with_aborts(
    seed: int,
    num_device_blocks: int,
    max_num_seqs: int,
    store_policy: str,
    aborts: list[tuple[int, int]],
    delays: list[int],
) -> None:
    """Random prompts over a few shared prefixes, added while the engine runs, some aborted at
    random steps, transfers completing ``delays`` steps late (deterministically): finished
    requests match the reference, aborted ones are a prefix of it."""
    prompts, params = random_mix(seed)
    want = reference_outputs(prompts, params)
    with tiny_engine(
        num_device_blocks=num_device_blocks,
        max_num_seqs=max_num_seqs,
        kv_offloading_size=host_gib(24),
        store_policy=store_policy,
    ) as engine:
        delay_completions(engine, lambda job_id: delays[job_id % len(delays)])
        ids, done = drive(engine, prompts, params, {step: i for i, step in aborts})
        assert_outputs_or_aborted_prefix(ids, done, want)
        assert_quiescent(engine)


def test_a_request_id_is_reserved_until_its_transfers_end() -> None:
    """A finished request whose stores still read its blocks keeps its id: reusing it before the
    blocks are freed is refused (its old transfers would free the new request's blocks)."""
    with tiny_engine(
        num_device_blocks=32, kv_offloading_size=host_gib(64), store_policy="on_finish"
    ) as engine:
        engine.add_request(random_tokens(random.Random(3), 20), greedy(2), request_id="a")
        finished: list[RequestOutput] = []
        while not finished:
            finished = engine.step()
        assert "a" in engine.scheduler.held
        with pytest.raises(ConfigError, match="already in use"):
            engine.add_request([1, 2, 3], greedy(1), request_id="a")
        engine.drain()
        engine.add_request([1, 2, 3], greedy(1), request_id="a")  # free again
        while engine.has_unfinished():
            engine.step()
        engine.drain()
        assert_quiescent(engine)
