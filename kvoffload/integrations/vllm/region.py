"""vLLM's shared CPU pool file for :class:`~kvoffload.integrations.vllm.spec.KVOffloadSpec`: its
name leaves ``/dev/shm`` as soon as every process that needs it has mapped it.

``SharedOffloadRegion`` keeps the pool in ``/dev/shm/vllm_offload_<engine_id>.mmap`` (its
documented name) and removes the name at ``cleanup`` in the process that created it. vLLM ends
its EngineCore and workers with ``timeout=0`` on SIGINT, and a start that fails after the workers
mapped the pool never reaches their cleanup: the file stayed behind, holding the pool's memory.

Every worker maps the pool while vLLM initialises the KV caches, before vLLM builds its scheduler
(0.32 and 0.33), and the scheduler side maps it last: :func:`open_scheduler_region` removes the
name right after mapping it when the file was there already (the workers' mappings, and ours,
stay valid; the kernel frees the memory when the last one goes, however the processes end). When
the scheduler side creates the file (no worker mapped it yet, e.g. scheduler-only use), the name
is kept for the workers to come and removed at cleanup, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

__all__ = ["open_scheduler_region", "region_path", "release_region"]

logger = logging.getLogger(__name__)


def region_path(engine_id: str) -> str:
    """The pool file of engine ``engine_id`` (``SharedOffloadRegion``'s documented name)."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


def open_scheduler_region(
    engine_id: str, num_chunks: int, kv_bytes_per_chunk: int, cpu_page_size: int
) -> SharedOffloadRegion:
    """Map the whole pool (``rank=None``) and remove its name if the workers mapped it first."""
    path = region_path(engine_id)
    workers_mapped = os.path.exists(path)
    region = SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=num_chunks,
        rank=None,
        kv_bytes_per_chunk=kv_bytes_per_chunk,
        cpu_page_size=cpu_page_size,
    )
    if workers_mapped and region.mmap_path == path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        logger.info("unlinked %s: every process that uses the pool has mapped it", path)
    return region


def release_region(region: SharedOffloadRegion) -> None:
    """``region.cleanup()``, for a region whose name may have been removed already (by
    :func:`open_scheduler_region`): vLLM 0.32's cleanup warns when its creator finds no name."""
    if region.mmap_path and not os.path.exists(region.mmap_path):
        region._creator = False  # the name is gone: nothing left for cleanup to unlink
    region.cleanup()
