"""Helpers for the end-to-end engine tests: small engines, workloads that cycle prefixes through
the host tier, reference runs, and the checks that nothing is left pinned, held or in flight."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import pytest
import torch

from kvoffload.engine import Engine, RequestOutput, SamplingParams
from kvoffload.events.messages import KVEventBatch
from kvoffload.events.publisher import NullEventPublisher
from kvoffload.manager_contract import OffloadingManager
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.worker import DelayedCompletionHandler

#: Engine block size of every test engine (small, so short prompts span many blocks).
BLOCK_SIZE = 4
#: KV bytes per token of the ``tiny`` preset in float32 (2 layers x K,V x 2 heads x 16 x 4 bytes).
TINY_KV_BYTES_PER_TOKEN = 512
#: Logprobs of the same tokens computed in different chunkings agree to this (float32 model).
LOGPROB_ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Autouse in every engine test module: the tiny model gains nothing from threads, and
    OpenMP's spinning threads slow every op down when the shared machine's cores are busy."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def host_gib(num_blocks: int, block_size: int = BLOCK_SIZE, factor: int = 1) -> float:
    """``kv_offloading_size`` (GiB) for a host tier of exactly ``num_blocks`` tiny-preset blocks."""
    return num_blocks * TINY_KV_BYTES_PER_TOKEN * block_size * factor / 2**30


def tiny_engine(**kwargs: Any) -> Engine:
    """A ``tiny`` engine with :data:`BLOCK_SIZE`-token blocks; ``kwargs`` override anything.
    Offloading engines load every hit (``load_policy="always"``: the tests of load mechanics
    need their loads whatever the measured costs say; ``test_load_policy.py`` tests ``auto``)."""
    options: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_device_blocks": 512,
        "load_policy": "always",
    }
    options.update(kwargs)
    return Engine("tiny", **options)


def delay_completions(engine: Engine, delay: Callable[[int], int]) -> DelayedCompletionHandler:
    """Report each of ``engine``'s transfer jobs ``delay(job_id)`` engine steps late, whatever the
    copy threads' timing: the run becomes reproducible step for step (loads and stores both)."""
    assert engine.worker is not None
    router = engine.worker.offloading_worker
    inner = router.handler("GPU", "CPU")
    handler = DelayedCompletionHandler(inner, lambda: int(engine.stats()["steps"]), delay)
    for direction in (("GPU", "CPU"), ("CPU", "GPU")):
        assert router.handler(*direction) is inner
        router.register_handler(*direction, handler, replace=True)
    return handler


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` byte-level token ids that are never EOS (256)."""
    return [rng.randrange(1, 256) for _ in range(n)]


def cycling_rounds(
    num_prefixes: int = 4,
    prefix_blocks: int = 6,
    suffix_len: int = 3,
    num_rounds: int = 3,
    seed: int = 0,
) -> list[list[list[int]]]:
    """Rounds of prompts; round ``r`` holds one prompt per shared prefix, each with a fresh suffix.

    Run round by round on an engine whose device cache holds fewer than ``num_prefixes``
    prefixes, every prefix is evicted from the device before its next round and must come back
    from the host tier.
    """
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_blocks * BLOCK_SIZE) for _ in range(num_prefixes)]
    return [[p + random_tokens(rng, suffix_len) for p in prefixes] for _ in range(num_rounds)]


def random_mix(seed: int, num_prompts: int = 12) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts over four shared prefixes of 2-6 blocks with short random suffixes, and greedy
    params of 1-15 tokens each. The longest request needs 47 tokens (12 blocks)."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, rng.randrange(2, 7) * BLOCK_SIZE) for _ in range(4)]
    prompts = [
        rng.choice(prefixes) + random_tokens(rng, rng.randrange(1, 9)) for _ in range(num_prompts)
    ]
    return prompts, [greedy(max_tokens=rng.randrange(1, 16)) for _ in prompts]


def run_until_done(
    engine: Engine, ids: Collection[str], max_steps: int = 5000
) -> dict[str, RequestOutput]:
    """Step ``engine`` until every request in ``ids`` finished (at most ``max_steps`` steps);
    every output of those steps by request id."""
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        for out in engine.step():
            done[out.request_id] = out
        if set(ids) <= done.keys():
            return done
    raise AssertionError(
        f"requests still unfinished after {max_steps} steps: {set(ids) - done.keys()}"
    )


def drive(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    abort_at: dict[int, int],
    max_steps: int = 5000,
    after_step: Callable[[], None] | None = None,
) -> tuple[list[str], dict[str, RequestOutput]]:
    """Add two requests a step while the engine runs; at step ``s`` abort request ``abort_at[s]``
    (if added by then); call ``after_step`` after every step. Returns the request ids in prompt
    order and every output."""
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    for step in range(max_steps):
        while len(ids) < min(len(prompts), 2 * (step + 1)):
            ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
        if step in abort_at and abort_at[step] < len(ids):
            engine.abort(ids[abort_at[step]])
        for out in engine.step():
            done[out.request_id] = out
        if after_step is not None:
            after_step()
        if len(done) == len(prompts):
            return ids, done
    raise AssertionError(f"{len(prompts) - len(done)} requests unfinished after {max_steps} steps")


def assert_outputs_or_aborted_prefix(
    ids: Sequence[str], done: dict[str, RequestOutput], want: Sequence[RequestOutput]
) -> None:
    """Finished requests match the reference; aborted ones generated a prefix of it."""
    for rid, ref in zip(ids, want, strict=True):
        out = done[rid]
        if out.finish_reason == "abort":
            assert out.output_token_ids == ref.output_token_ids[: len(out.output_token_ids)]
        else:
            assert_same_outputs([out], [ref])


def greedy(max_tokens: int = 6, logprobs: int | None = -1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def reference_outputs(
    prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
) -> list[RequestOutput]:
    """Outputs of a run with a device cache that holds everything and no offloading."""
    with tiny_engine(num_device_blocks=2048) as engine:
        return engine.generate(prompts, sampling)


def run_rounds(
    engine: Engine, rounds: Sequence[Sequence[Sequence[int]]], sampling: SamplingParams
) -> list[list[RequestOutput]]:
    """Generate each round to completion, draining the engine's transfers between rounds."""
    out = []
    for prompts in rounds:
        out.append(engine.generate(prompts, sampling))
        engine.drain()
    return out


def assert_same_outputs(
    got: Sequence[RequestOutput], want: Sequence[RequestOutput], atol: float = LOGPROB_ATOL
) -> None:
    """Identical tokens; full-vocabulary logprobs (when both have them) within ``atol``."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.output_token_ids == w.output_token_ids, g.request_id
        if g.logprobs is None or w.logprobs is None:
            continue
        assert len(g.logprobs) == len(w.logprobs)
        for step, (lg, lw) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
            assert lg.keys() == lw.keys()
            a = torch.tensor([lg[k] for k in sorted(lg)], dtype=torch.float64)
            b = torch.tensor([lw[k] for k in sorted(lw)], dtype=torch.float64)
            diff = (a - b).abs().max().item()
            assert diff <= atol, f"{g.request_id} token {step}: logprobs differ by {diff}"


def backing_manager(engine: Engine) -> CPUOffloadingManager:
    """The engine's host-tier manager, unwrapped from the reuse filter or the tiering manager."""
    manager: OffloadingManager | None = engine.manager
    if isinstance(manager, FilterReusedOffloadingManager):
        manager = manager.backing
    if isinstance(manager, TieringOffloadingManager):
        manager.check_invariants()
        manager = manager.host
    assert isinstance(manager, CPUOffloadingManager)
    return manager


def assert_quiescent(engine: Engine) -> None:
    """Drain, then check nothing is left: no request, job, held or used device block, pin or pending
    tier block; the tier's slot accounting is consistent."""
    engine.drain()
    scheduler = engine.scheduler
    assert not scheduler.has_work
    assert not scheduler.held
    assert not scheduler.loading and not scheduler.running and not scheduler.waiting
    scheduler.waiting.check_invariants()
    assert engine.pool.num_free_blocks == engine.num_device_blocks
    assert all(block.ref_cnt == 0 for block in engine.pool.blocks)
    if engine.connector is None:
        return
    assert not engine.connector.has_pending_jobs()
    stats = engine.stats()
    assert stats["offload_live_requests"] == 0
    assert stats["offload_jobs_in_flight"] == 0
    assert engine.worker is not None and engine.worker.num_in_flight == 0
    manager = backing_manager(engine)
    pinned = {key.hex(): block.ref_cnt for key, block in manager.items() if block.ref_cnt != 0}
    assert not pinned, f"tier blocks still pinned or pending: {pinned}"
    manager.check_invariants()


class EventCollector(NullEventPublisher):
    """Keeps every published batch (stands in for the network; the engine's events are real):
    set ``engine.publisher`` to one."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        super().publish(batch)
        self.batches.append(batch)
