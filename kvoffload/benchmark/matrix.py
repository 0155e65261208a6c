"""Which runs ``bench throughput`` makes: the run matrix, each run a label and its engine settings.

Without ``compare`` one run: the workload with the tiers asked for. With it, side by side: no
offloading, offloading (host tier, plus the remote tier when asked), host + disk when a disk tier
is asked for, and an unlimited device cache (the ideal: sized from the requests with
:func:`size_unlimited`). With two instances (engine B on engine A's prefixes) the runs are engine
B's: no offloading, (with ``compare``: host only,) host + remote, (unlimited device cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.errors import ConfigError

__all__ = [
    "NO_OFFLOADING",
    "PLACEHOLDER_URL",
    "UNLIMITED",
    "Run",
    "actual_label",
    "run_matrix",
    "size_unlimited",
    "unlimited_device_blocks",
]

NO_OFFLOADING = "no offloading"
UNLIMITED = "unlimited device cache"
#: ``kv_remote_url`` of two instances' runs until their own Redis server is started.
PLACEHOLDER_URL = "redis://127.0.0.1:6379/0"
_REMOTE = " + remote"


@dataclass
class Run:
    """One configuration: its label and the ``Engine`` keyword arguments it runs with."""

    label: str
    engine_kwargs: dict[str, Any]

    @property
    def remote(self) -> bool:
        return self.engine_kwargs.get("kv_remote_url") is not None


def run_matrix(
    engine_kwargs: Mapping[str, Any],
    disk: Mapping[str, Any] | None = None,
    remote: Mapping[str, Any] | None = None,
    *,
    compare: bool = False,
    instances: int = 1,
) -> list[Run]:
    """The runs, in the order they are shown. ``engine_kwargs``: the settings of every run (the
    host tier's size included); ``disk`` / ``remote``: the settings of that tier, when asked for
    (two instances' remote tier without a URL gets :data:`PLACEHOLDER_URL` until its server is
    started).
    Every run's settings are checked (:class:`ConfigError`) before any runs."""
    from kvoffload.engine import EngineConfig

    two = instances == 2
    if two and (remote is None or remote.get("kv_remote_url") is None):
        remote = {**(remote or {}), "kv_remote_url": PLACEHOLDER_URL}
    runs: list[Run] = []
    if compare or two:
        runs.append(Run(NO_OFFLOADING, {**engine_kwargs, "kv_offloading_size": 0.0}))
    if two and compare:
        runs.append(Run("offloading", dict(engine_kwargs)))
    plus = _REMOTE if remote else ""
    offloading = {**engine_kwargs, **(remote or {})}
    if disk is None or compare:
        runs.append(Run("offloading" + plus, offloading))
    if disk is not None:
        runs.append(Run("offloading + disk" + plus, {**offloading, **disk}))
    if compare:
        # Sized from the requests by size_unlimited; a placeholder that passes the checks here.
        ideal = {
            **engine_kwargs,
            "kv_offloading_size": 0.0,
            "enable_prefix_caching": True,
            "num_device_blocks": 1,
        }
        ideal.pop("kv_cache_memory", None)
        runs.append(Run(UNLIMITED, ideal))
    for run in runs:
        EngineConfig(**run.engine_kwargs)
    return runs


def unlimited_device_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    """Device blocks that hold every distinct prompt block plus every request's own tail, so
    that nothing is ever evicted (the "ideal" run)."""
    if block_size <= 0:
        raise ConfigError("block_size", f"must be a positive integer, got {block_size}")
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, tokens) -> id
    tails = 0
    for r in requests:
        full = len(r.prompt) // block_size
        parent = -1
        for b in range(full):
            parent = block_ids.setdefault(
                (parent, tuple(r.prompt[b * block_size : (b + 1) * block_size])), len(block_ids)
            )
        tails += -(-(len(r.prompt) - full * block_size + r.output_len) // block_size) + 1
    return len(block_ids) + tails


def size_unlimited(runs: Sequence[Run], requests: Sequence[BenchRequest]) -> None:
    """Give the unlimited-device-cache run, if any, room for every block of ``requests``."""
    from kvoffload.engine import EngineConfig

    for run in runs:
        if run.label == UNLIMITED:
            block_size = EngineConfig(**run.engine_kwargs).block_size
            run.engine_kwargs["num_device_blocks"] = unlimited_device_blocks(requests, block_size)


def actual_label(run: Run, stats: Mapping[str, float]) -> str:
    """The run's label as it ran: a remote tier that was optional and down at start (no remote
    tier statistics) is not claimed."""
    if run.remote and "offload_tier_remote_stored_blocks" not in stats:
        return run.label.replace(_REMOTE, "") + " (remote tier down: ran without it)"
    return run.label
