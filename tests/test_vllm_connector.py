"""vLLM 0.33's scheduler-side ``OffloadingConnector`` running requests through ``KVOffloadSpec``.

The connector is built exactly as vLLM's scheduler builds it (``OffloadingConnector(vllm_config,
KVConnectorRole.SCHEDULER, kv_cache_config)``, which translates the config and loads our spec
through ``OffloadingSpecFactory``). The model config is a stand-in (a real ``ModelConfig``
inspects the model's code, which needs GPU-only modules); everything else is vLLM's own:
``VllmConfig``, ``KVCacheConfig``, ``Request`` with vLLM's block hasher, ``SchedulerOutput``,
the connector's calls in the order vLLM's v1 scheduler makes them. The GPU worker is stood in
for by copying, for each job of the connector's metadata, between a NumPy "GPU" cache and a
second mapping of the shared CPU pool, then reporting the job done as vLLM's worker does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import xxhash
from vllm_cases import require_vllm, unique_engine_id

require_vllm()

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvoffload.integrations.vllm.manager import KVOffloadManager  # noqa: E402

BLOCK_TOKENS = 16
NUM_GPU_BLOCKS = 64
ATTENTION = FullAttentionSpec(
    block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=16, dtype=torch.float16
)


class ConnectorHarness:
    """vLLM's scheduler-side connector with our spec, a stand-in GPU cache and worker."""

    def __init__(self, extra: dict[str, Any], num_cpu_chunks: int = 16) -> None:
        self.engine_id = unique_engine_id()
        page = ATTENTION.page_size_bytes
        chunk = -(-page // 4096) * 4096  # vLLM aligns a CPU chunk to 4 KiB
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=self.engine_id,
            kv_connector_extra_config={
                "spec_name": "KVOffloadSpec",
                "spec_module_path": "kvoffload.integrations.vllm.spec",
                "cpu_bytes_to_use": num_cpu_chunks * chunk,
                **extra,
            },
        )
        vllm_config = VllmConfig(
            cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
            parallel_config=ParallelConfig(),
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=transfer,
        )
        vllm_config.model_config = SimpleNamespace(  # type: ignore[assignment]  # the fields it reads
            model="kvo-test-model",
            dtype=torch.float16,
            max_model_len=4096,
            use_mla=False,
            get_total_num_kv_heads=lambda: ATTENTION.num_kv_heads,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_GPU_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.attn"], ATTENTION)],
        )
        self.connector = OffloadingConnector(
            vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
        )
        manager = self.connector.scheduler.manager
        assert isinstance(manager, KVOffloadManager)
        self.manager = manager
        self.region = SharedOffloadRegion(
            engine_id=self.engine_id,
            num_chunks=num_cpu_chunks,
            rank=0,
            kv_bytes_per_chunk=chunk,
            cpu_page_size=chunk,
        )
        self._view = self.region.create_kv_memoryview()
        self.cpu = np.asarray(self._view)
        self.gpu = np.zeros((NUM_GPU_BLOCKS, page), dtype=np.uint8)
        self._free_blocks = list(range(1, NUM_GPU_BLOCKS))  # block 0 is vLLM's null block
        init_none_hash(sha256_cbor)
        self._hasher = get_request_block_hasher(BLOCK_TOKENS, sha256_cbor)
        self._ids = itertools.count()
        self.loaded_blocks = 0

    # -- the stand-in worker ---------------------------------------------------------------------

    def run_worker(self, meta: Any) -> None:
        """Do the metadata's transfers (loads, then stores) and report them done."""
        done = OffloadingWorkerMetadata()
        page = self.gpu.shape[1]
        for job_id, job in meta.load_jobs.items():
            for chunk, block in zip(job.src_spec.block_ids, job.dst_spec.block_ids, strict=True):
                self.gpu[block] = self.cpu[chunk][:page]
                self.loaded_blocks += 1
            done.mark_completed(job_id)
        for job_id, job in meta.store_jobs.items():
            for block, chunk in zip(job.src_spec.block_ids, job.dst_spec.block_ids, strict=True):
                self.cpu[chunk][:page] = self.gpu[block]
            done.mark_completed(job_id)
        self.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=done))

    # -- the stand-in scheduler ------------------------------------------------------------------

    def serve(self, tokens: list[int]) -> tuple[int, list[bytes]]:
        """Run one request through prefill and finish as vLLM's scheduler would; return the
        tokens the connector loaded and the KV bytes of the request's full blocks."""
        request = Request(
            f"req-{next(self._ids)}",
            tokens,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self._hasher,
        )
        c = self.connector
        c.on_new_request(request)
        hit, load_async = c.get_num_new_matched_tokens(request, 0)
        assert hit is not None
        num_blocks = -(-len(tokens) // BLOCK_TOKENS)
        block_ids = [self._free_blocks.pop() for _ in range(num_blocks)]
        c.update_state_after_alloc(
            request, KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],)), hit
        )
        if load_async:  # WAITING_FOR_REMOTE_KVS: the load runs in a step of its own
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.step([], {})
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit
        # The forward pass writes the KV of the blocks it computes (content = f(prefix)).
        for i in range(hit // BLOCK_TOKENS, num_blocks):
            self.gpu[block_ids[i]] = kv_of(tokens[: (i + 1) * BLOCK_TOKENS])
        new = NewRequestData.from_request(request, (block_ids,))
        self.step([new], {request.request_id: len(tokens) - hit})
        request.num_computed_tokens = len(tokens)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        full = len(tokens) // BLOCK_TOKENS
        kv = [self.gpu[b].tobytes() for b in block_ids[:full]]
        c.request_finished(request, block_ids)
        self.step([], {}, finished={request.request_id})
        self.step([], {})  # stores issued at the finish complete
        self._free_blocks.extend(block_ids)
        return hit, kv

    def step(self, new: list, scheduled: dict[str, int], finished: set[str] | None = None) -> None:
        output = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=finished or set(),
            free_encoder_mm_hashes=[],
        )
        self.run_worker(self.connector.build_connector_meta(output))

    def close(self) -> None:
        del self.cpu
        self._view.release()
        self.region.cleanup()
        self.connector.shutdown()


def kv_of(prefix: list[int]) -> np.ndarray:
    """The KV bytes the stand-in model computes for the last block of ``prefix``."""
    rng = np.random.default_rng(
        xxhash.xxh64_intdigest(np.asarray(prefix, dtype=np.int64).tobytes())
    )
    return rng.integers(0, 256, ATTENTION.page_size_bytes, dtype=np.uint8)


@pytest.fixture
def harness() -> Iterator[ConnectorHarness]:
    # Every hit loaded: these tests are about what a load brings (``auto``: at the end).
    h = ConnectorHarness({"eviction_policy": "prefix", "kvoffload_load_policy": "always"})
    yield h
    h.close()


@pytest.fixture
def auto_harness() -> Iterator[ConnectorHarness]:
    h = ConnectorHarness({"eviction_policy": "prefix"}, num_cpu_chunks=32)
    yield h
    h.close()


def test_a_shared_prefix_is_loaded_from_our_cpu_tier(harness: ConnectorHarness) -> None:
    prompt = list(range(64))  # 4 blocks
    hit, kv_first = harness.serve(prompt)
    assert hit == 0
    hit, kv_second = harness.serve(prompt[:48] + [999] * 16)  # shares 3 blocks
    assert hit == 48
    assert harness.loaded_blocks == 3
    assert kv_second[:3] == kv_first[:3]  # the loaded KV is the stored KV, byte for byte
    stats = harness.manager.inner.stats()
    assert stats["stored_blocks"] >= 4 and stats["loaded_blocks"] == 3


def test_requests_under_pressure_never_load_wrong_kv(harness: ConnectorHarness) -> None:
    rng = np.random.default_rng(0)
    prefixes = [list(rng.integers(0, 30_000, 32)) for _ in range(6)]
    for i in range(30):
        head = prefixes[int(rng.integers(0, len(prefixes)))]
        tail = list(rng.integers(0, 30_000, 16 * int(rng.integers(1, 4))))
        prompt = [int(t) for t in head + tail]
        hit, kv = harness.serve(prompt)
        assert hit % BLOCK_TOKENS == 0
        for j, block_kv in enumerate(kv):  # every block, loaded or computed, is the right KV
            assert block_kv == kv_of(prompt[: (j + 1) * BLOCK_TOKENS]).tobytes(), (i, j)
    assert harness.loaded_blocks > 0


# -- load_policy "auto": vLLM is answered MISS past the prefix that pays -------------------------

#: Computing costs 1 ms a token (16 ms a block); loading nearly nothing; one more step 50 ms:
#: a hit of 3 blocks (48 ms) is computed, one of 4 blocks (64 ms) is loaded.
STEP_50MS = {"token_s": 1e-3, "step_s": 0.05, "host": 1e-7}


def _prompt(seed: int, blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30_000, blocks * BLOCK_TOKENS)]


def test_auto_answers_miss_for_a_hit_too_short_to_pay(auto_harness: ConnectorHarness) -> None:
    h = auto_harness
    h.manager.costs.pin(STEP_50MS)
    base = _prompt(1, 6)
    h.serve(base)
    hit, kv = h.serve(base[: 3 * BLOCK_TOKENS] + _prompt(2, 2))  # 3 shared blocks: computed
    assert hit == 0 and h.loaded_blocks == 0
    assert h.manager.load_stats()["recomputed_by_choice_tokens_host"] == 3 * BLOCK_TOKENS
    assert kv[0] == kv_of(base[:BLOCK_TOKENS]).tobytes()
    hit, kv = h.serve(base[: 4 * BLOCK_TOKENS] + _prompt(3, 2))  # 4 shared blocks: loaded
    assert hit == 4 * BLOCK_TOKENS and h.loaded_blocks == 4
    for j, block_kv in enumerate(kv[:4]):
        assert block_kv == kv_of(base[: (j + 1) * BLOCK_TOKENS]).tobytes()
    # The scheduler's own steps were timed against the blocks they offered to store.
    assert h.manager.costs.measured()["compute"]
    assert h.manager.load_stats()["cost_token_s"] == STEP_50MS["token_s"]  # pinned, reported


def test_a_decline_is_counted_once_however_often_vllm_asks_again(
    auto_harness: ConnectorHarness,
) -> None:
    """vLLM re-asks a waiting request every step until it is scheduled (here: three steps with
    no room for it); each pass declines the same 3-block hit, counted once, at its finish."""
    h = auto_harness
    h.manager.costs.pin(STEP_50MS)
    base = _prompt(9, 5)
    h.serve(base)
    c = h.connector
    waiting = Request("waiting", base[: 3 * BLOCK_TOKENS] + _prompt(10, 2),
                      SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
    c.on_new_request(waiting)
    for _ in range(3):
        assert c.get_num_new_matched_tokens(waiting, 0) == (0, False)
        h.step([], {})
    stats = h.manager.load_stats
    assert stats().get("recomputed_by_choice_tokens_host", 0) == 0  # not acted on yet
    hit, _ = h.serve(base[: 3 * BLOCK_TOKENS] + _prompt(11, 2))  # another such request, served
    assert hit == 0
    assert stats()["recomputed_by_choice_tokens_host"] == 3 * BLOCK_TOKENS
    waiting.status = RequestStatus.FINISHED_ABORTED
    c.request_finished(waiting, [])
    h.step([], {}, finished={waiting.request_id})
    assert stats()["recomputed_by_choice_tokens_host"] == 6 * BLOCK_TOKENS  # once, not 3 times


def test_auto_recomputes_a_hit_slower_to_load_than_to_compute(
    auto_harness: ConnectorHarness,
) -> None:
    h = auto_harness
    h.manager.costs.pin({"token_s": 1e-3, "step_s": 0.0, "host": 1.0})
    base = _prompt(4, 5)
    h.serve(base)
    hit, _ = h.serve(base[: 4 * BLOCK_TOKENS] + _prompt(5, 1))
    assert hit == 0 and h.loaded_blocks == 0
    h.manager.costs.pin({"token_s": 1e-3, "step_s": 0.0, "host": 1e-7})
    hit, _ = h.serve(base[: 4 * BLOCK_TOKENS] + _prompt(6, 1))
    assert hit == 4 * BLOCK_TOKENS


@pytest.mark.parametrize("policy,want_hit", [("always", 3 * BLOCK_TOKENS), ("never", 0)])
def test_always_and_never_ignore_the_costs(policy: str, want_hit: int) -> None:
    h = ConnectorHarness({"eviction_policy": "prefix", "kvoffload_load_policy": policy})
    try:
        h.manager.costs.pin(STEP_50MS)  # auto would compute this 3-block hit
        base = _prompt(7, 4)
        h.serve(base)
        hit, _ = h.serve(base[: 3 * BLOCK_TOKENS] + _prompt(8, 1))
        assert hit == want_hit
        assert h.manager.inner.stats()["stored_blocks"] > 0  # stores happen either way
    finally:
        h.close()


def test_an_unknown_load_policy_is_a_config_error() -> None:
    from kvoffload.errors import ConfigError

    with pytest.raises(ConfigError, match="kvoffload_load_policy"):
        ConnectorHarness({"kvoffload_load_policy": "sometimes"})
