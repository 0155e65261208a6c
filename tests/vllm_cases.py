"""Shared helpers of the vLLM plug-in tests (``tests/test_vllm_*.py``, ``make test-vllm``).

:func:`require_vllm` skips a whole module, loudly, when vLLM 0.33.0's offloading modules cannot
be imported (``make test-vllm`` installs them); the conftest repeats the reason as a red banner
at the end of the run. :func:`offloading_config` builds vLLM's own ``OffloadingConfig``
(the scheduler side needs no ``VllmConfig``, no model and no GPU).
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Any

import pytest

VLLM_VERSION = "0.33.0"


def installed_problem() -> str | None:
    """Cheap check (package metadata, no import): ``None`` when vLLM VLLM_VERSION is installed."""
    from importlib import metadata

    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "vllm is not installed"
    if version != VLLM_VERSION:
        return f"vLLM {version} is installed; these tests are for {VLLM_VERSION}"
    return None


@functools.cache
def import_problem() -> str | None:
    """``None`` when vLLM's offloading modules import, else why not (imports vLLM: ~10 s)."""
    problem = installed_problem()
    if problem is not None:
        return problem
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except Exception as exc:
        return f"cannot import vLLM's offloading modules ({type(exc).__name__}: {exc})"
    return None


#: Starts every skip reason of these tests (the conftest finds them by it).
SKIP_MARK = f"vLLM {VLLM_VERSION} NOT AVAILABLE"


def skip_reason(problem: str) -> str:
    return (
        f"{SKIP_MARK}, the vLLM plug-in tests DID NOT RUN: {problem}. "
        "Run `make test-vllm` to install it (--no-deps, from a per-machine cache)."
    )


def require_vllm() -> None:
    """Skip the calling test module (loudly) when vLLM's offloading modules don't import."""
    problem = import_problem()
    if problem is not None:
        pytest.skip(skip_reason(problem), allow_module_level=True)


_engine_ids = itertools.count()


def unique_engine_id() -> str:
    """An engine id no live manager uses (it names the shared-memory pool file)."""
    return f"kvo-test-{os.getpid()}-{next(_engine_ids)}"


def offloading_config(
    extra_config: dict[str, Any],
    *,
    num_chunks: int,
    chunk_bytes: int = 4096,
    tokens_per_block: int = 16,
    enable_events: bool = True,
    engine_id: str | None = None,
) -> Any:
    """vLLM's ``OffloadingConfig`` for a one-group model whose chunks are ``chunk_bytes``
    (a multiple of vLLM's 4 KiB alignment) and a CPU tier of ``num_chunks`` chunks."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    extra = {"cpu_bytes_to_use": num_chunks * chunk_bytes, **extra_config}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("model.layers.0.attn",), 0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=enable_events,
        extra_config=extra,
        engine_id=engine_id or unique_engine_id(),
        model=OffloadingModelConfig(name="kvo-test-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def vllm_keys(n: int, start: int = 0) -> list[bytes]:
    """``n`` distinct vLLM offload keys (32-byte hashes, group 0)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]
