"""Data types shared by the scheduler side (which plans transfers) and the worker side (which runs
them). Both import this module; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.manager_contract import LoadStoreSpec

__all__ = ["ConnectorMetadata", "TransferJob", "TransferResult"]


@dataclass(slots=True)
class TransferJob:
    """One planned copy: every block of ``src`` to the co-indexed place in ``dst``.

    Job ids are unique per scheduler, shared by loads and stores, and increase monotonically.
    A load's ``dst`` (and a store's ``src``) is a :class:`~kvoffload.load_store_specs.GPULoadStoreSpec`.
    """

    job_id: int
    req_id: str
    src: LoadStoreSpec
    dst: LoadStoreSpec

    @property
    def is_store(self) -> bool:
        """True when the job copies out of the engine's cache into a tier."""
        return self.src.medium == "GPU"


@dataclass(slots=True)
class ConnectorMetadata:
    """What the scheduler side hands the worker side for one engine step.

    The worker submits ``load_jobs`` before the forward pass and ``store_jobs`` after it (their
    source KV is written by this step's forward pass). ``jobs_to_flush`` are store jobs that must
    finish before this step's forward pass may overwrite their source blocks (a preempted request's
    blocks, or blocks reallocated while a store was still reading them).
    """

    load_jobs: list[TransferJob] = field(default_factory=list)
    store_jobs: list[TransferJob] = field(default_factory=list)
    jobs_to_flush: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TransferResult:
    """The outcome of one job on one worker, reported exactly once.

    ``success=False`` means the destination must be treated as garbage: a failed load makes the
    request recompute those tokens, a failed store leaves the blocks "not offloaded".
    ``direction`` is ``(source medium, destination medium)``, e.g. ``("GPU", "CPU")``.
    """

    job_id: int
    success: bool
    num_bytes: int = 0
    seconds: float = 0.0
    direction: tuple[str, str] = ("", "")
