"""The offloading half of an engine, assembled from its settings.

::

    OffloadingConnectorScheduler ── manager: FilterReusedOffloadingManager (store_threshold >= 2)
        └── TieringOffloadingManager (a disk or remote tier is set)
              ├── CPUOffloadingManager (host tier: the worker's host pool)
              └── secondary tiers, nearest first (kvoffload.tiers.factory)
    OffloadingConnectorWorker: copies device <-> host pool on its threads

Every resource is registered in ``owned`` (shutdown callables, released last first) as soon as
it exists, so a build that fails half way releases what it had acquired.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.model_config import ModelConfig
from kvoffload.errors import ConfigError, HostAllocationError
from kvoffload.manager_contract import OffloadingManager
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.scheduler import OffloadingConnectorScheduler, SchedulerOffloadConfig
from kvoffload.scheduler.events import OffloadEventDescriber
from kvoffload.tiers import KVLayout
from kvoffload.tiers.factory import build_secondary_tiers
from kvoffload.worker import OffloadingConnectorWorker

__all__ = ["OffloadStack", "build_offload_stack", "kv_layout"]

_GIB = 2**30
Owned = list[Callable[[], object]]


@dataclass(frozen=True, slots=True)
class OffloadStack:
    """What an engine offloads through. ``manager`` is what the connector talks to (the reuse
    filter, the tiering manager or the host tier, outermost first); ``tiering`` is set when a
    secondary tier is."""

    worker: OffloadingConnectorWorker
    manager: OffloadingManager
    tiering: TieringOffloadingManager | None
    connector: OffloadingConnectorScheduler


@dataclass(frozen=True, slots=True)
class DeviceCache:
    """The engine's device KV cache, as the offload stack sees it."""

    kv_cache: torch.Tensor
    num_blocks: int
    model_config: ModelConfig
    #: The model's name in shared tiers (see :func:`kv_layout`); called only when one is set.
    model_identity: Callable[[], str]


def build_offload_stack(
    config: EngineConfig, device: DeviceCache, enable_events: bool, owned: Owned
) -> OffloadStack:
    """Build the stack ``config`` asks for (``config.offloading`` must be on) over ``device``."""
    worker = _start_worker(config, device, owned)
    host = CPUOffloadingManager(
        worker.num_host_blocks, config.eviction_policy, enable_events=enable_events
    )
    manager: OffloadingManager = host
    tiering = None
    if config.kv_disk_path is not None or config.kv_remote_url is not None:
        layout = kv_layout(config, device, worker.bytes_per_offloaded_block)
        tiers = build_secondary_tiers(config, worker.host_pool.memoryview(), layout, enable_events)
        if tiers:
            tiering = TieringOffloadingManager(
                host,
                tiers,
                config.kv_tier_cascade,
                max_in_flight=config.kv_tier_write_max_in_flight,
                min_reuse=config.kv_tier_write_min_reuse,
                promotion_wait_s=config.kv_promotion_wait_s,
            )
            # Tier threads write into the host pool: they stop before the worker frees it.
            owned.append(functools.partial(_drain_and_close, tiering))
            manager = tiering
    if config.store_threshold >= 2:
        manager = FilterReusedOffloadingManager(manager, config.store_threshold)
    sched_config = SchedulerOffloadConfig.single_group(
        config.block_size,
        config.block_size_factor,
        store_policy=config.store_policy,
        max_lookup_retry_s=config.kv_lookup_retry_s,
        max_stores_in_flight=(
            max(1, worker.num_host_blocks // 2)
            if config.kv_store_max_in_flight is None
            else config.kv_store_max_in_flight
        ),
        load_policy=config.load_policy,
    )
    describer = OffloadEventDescriber(config.events.int_block_hashes) if enable_events else None
    connector = OffloadingConnectorScheduler(sched_config, manager, describer)
    return OffloadStack(worker, manager, tiering, connector)


def _drain_and_close(tiering: TieringOffloadingManager) -> None:
    """Let ``tiering``'s jobs finish, then close its tiers (their threads stop)."""
    tiering.drain()
    tiering.close()


def _start_worker(
    config: EngineConfig, device: DeviceCache, owned: Owned
) -> OffloadingConnectorWorker:
    """The connector worker with its host pool of ``kv_offloading_size`` GiB, registered on the
    device cache; :class:`ConfigError` naming ``kv_offloading_size`` if it holds no offloaded
    block or cannot be allocated."""
    host_bytes = int(config.kv_offloading_size * _GIB)
    block_bytes = (
        device.model_config.kv_bytes_per_token(device.kv_cache.element_size())
        * config.block_size
        * config.block_size_factor
    )
    if host_bytes < block_bytes:
        raise ConfigError(
            "kv_offloading_size",
            f"{config.kv_offloading_size} GiB ({host_bytes} bytes) holds no offloaded block: "
            f"one is {block_bytes} bytes (block_size {config.block_size} x "
            f"block_size_factor {config.block_size_factor} tokens); use at least "
            f"{block_bytes / _GIB:.3g} GiB",
        )
    worker = OffloadingConnectorWorker(config.block_size_factor, host_bytes)
    owned.append(worker.shutdown)
    try:
        worker.register_kv_caches([device.kv_cache], num_blocks=device.num_blocks, block_dim=0)
    except HostAllocationError as exc:
        raise ConfigError("kv_offloading_size", f"{config.kv_offloading_size} GiB: {exc}") from exc
    return worker


def kv_layout(config: EngineConfig, device: DeviceCache, block_bytes: int) -> KVLayout:
    """What an offloaded block's bytes mean (stored with every block a secondary tier holds)."""
    mc = device.model_config
    return KVLayout(
        model=device.model_identity(),
        dtype=str(device.kv_cache.dtype),
        tokens_per_block=config.block_size * config.block_size_factor,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_bytes=block_bytes,
    )
