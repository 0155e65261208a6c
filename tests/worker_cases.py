"""Shared builders for the worker-side tests: KV cache layouts, devices, byte-exact page access.

Pages are read through the engine's own tensors (``tensor.select(block_dim, block)``), never
through kvoffload's page views, so the tests check the layout code instead of trusting it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from kvoffload.transfer import TransferResult
from kvoffload.worker import KVCacheLayout, OffloadingConnectorWorker

_CUDA = [pytest.mark.cuda]  # skipped without a device by tests/conftest.py

#: Devices every layout test runs on.
DEVICES = ["cpu", pytest.param("cuda", marks=_CUDA)]

#: (device, use_torch_copies): the threaded CPU handler, the torch reference on CPU, CUDA.
HANDLERS = [
    pytest.param("cpu", False, id="cpu-threads"),
    pytest.param("cpu", True, id="cpu-torch"),
    pytest.param("cuda", False, id="cuda", marks=_CUDA),
]

LAYOUTS = [
    "per_layer",
    "kv_split",
    "cross_layer",
    "layer_views_of_cross",
    "kv_split_block_outer",
    "two_groups",
]


@dataclass
class Cache:
    """The engine's KV tensors, each with its block dim, and the groups they form."""

    tensors: list[torch.Tensor]
    block_dims: list[int]
    group_tensors: list[list[int]]
    num_blocks: int

    def page(self, t: int, block: int) -> torch.Tensor:
        """Tensor ``t``'s bytes for engine ``block`` (a copy, uint8)."""
        return (
            self.tensors[t]
            .select(self.block_dims[t], block)
            .contiguous()
            .view(torch.uint8)
            .flatten()
            .cpu()
            .clone()
        )

    def group_pages(self, group: int, block: int) -> list[torch.Tensor]:
        return [self.page(t, block) for t in self.group_tensors[group]]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors]

    def randomize(self, seed: int = 0) -> None:
        gen = torch.Generator(device=self.tensors[0].device).manual_seed(seed)
        for t in self.tensors:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))

    def poison_blocks(self, blocks: list[int], value: float = -7.0) -> None:
        for t, bd in zip(self.tensors, self.block_dims, strict=True):
            for b in blocks:
                t.select(bd, b).fill_(value)


def make_cache(
    layout: str, device: str = "cpu", num_blocks: int = 24, layers: int = 3, dtype=torch.bfloat16
) -> Cache:
    """A small KV cache in ``layout`` (one of :data:`LAYOUTS`); block = [2, tokens=4, heads=2, dim=8]."""
    block = (2, 4, 2, 8)
    kw = {"dtype": dtype, "device": device}
    if layout == "per_layer":
        ts = [torch.zeros(num_blocks, *block, **kw) for _ in range(layers)]
        return Cache(ts, [0] * layers, [list(range(layers))], num_blocks)
    if layout == "kv_split":
        ts = [torch.zeros(2, num_blocks, *block[1:], **kw) for _ in range(layers)]
        return Cache(ts, [1] * layers, [list(range(layers))], num_blocks)
    if layout == "cross_layer":
        return Cache([torch.zeros(num_blocks, layers, *block, **kw)], [0], [[0]], num_blocks)
    if layout == "layer_views_of_cross":
        cross = torch.zeros(num_blocks, layers, *block, **kw)
        return Cache(list(cross.unbind(1)), [0] * layers, [list(range(layers))], num_blocks)
    if layout == "kv_split_block_outer":  # logical [2, N, ...], physically [N, 2, ...]
        ts = [torch.zeros(num_blocks, *block, **kw).transpose(0, 1) for _ in range(layers)]
        return Cache(ts, [1] * layers, [list(range(layers))], num_blocks)
    if layout == "two_groups":  # a full-attention group and a smaller sliding-window-like group
        full = [torch.zeros(num_blocks, *block, **kw) for _ in range(2)]
        small = [torch.zeros(2, num_blocks, 4, 1, 8, **kw)]
        return Cache([*full, *small], [0, 0, 1], [[0, 1], [2]], num_blocks)
    raise ValueError(layout)


def make_worker(
    cache: Cache, factor: int | list[int], num_slots: int, use_torch_copies: bool = False, **kw
) -> OffloadingConnectorWorker:
    """A registered connector worker whose host pool holds exactly ``num_slots`` blocks."""
    slot_bytes = KVCacheLayout.from_kv_caches(
        cache.tensors, factor, cache.num_blocks, cache.group_tensors
    ).slot_bytes
    worker = OffloadingConnectorWorker(
        factor, num_slots * slot_bytes, use_torch_copies=use_torch_copies, **kw
    )
    worker.register_kv_caches(
        cache.tensors, num_blocks=cache.num_blocks, group_tensors=cache.group_tensors
    )
    assert worker.num_host_blocks == num_slots
    return worker


#: Byte value the host pool is filled with before a test: slots no copy may touch keep it.
HOST_POISON = 0xAB


def finish(
    worker: OffloadingConnectorWorker, job_ids: list[int], timeout: float = 20.0
) -> dict[int, TransferResult]:
    """Flush ``job_ids`` and collect their results; each must be reported exactly once."""
    worker.handle_preemptions(job_ids, timeout)
    got: dict[int, TransferResult] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(job_ids):
        assert time.monotonic() < deadline, f"jobs {set(job_ids) - set(got)} never reported"
        for result in worker.get_finished():
            assert result.job_id not in got, f"job {result.job_id} reported twice"
            got[result.job_id] = result
        time.sleep(0.001)
    assert set(got) == set(job_ids)
    return got
