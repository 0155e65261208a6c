"""Transfer statistics of the worker side: jobs, failures, bytes and seconds per direction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload.transfer import TransferResult

__all__ = ["DirectionStats", "TransferStats"]


@dataclass(slots=True)
class DirectionStats:
    """Monotonic counters of one direction. ``seconds`` sums each job's copy time."""

    jobs: int = 0
    failed_jobs: int = 0
    bytes: int = 0
    seconds: float = 0.0


class TransferStats:
    """Counters per direction ``(src medium, dst medium)``, fed with every reported result."""

    def __init__(self) -> None:
        self.by_direction: dict[tuple[str, str], DirectionStats] = {}

    def record(self, results: Iterable[TransferResult]) -> None:
        for result in results:
            stats = self.by_direction.get(result.direction)
            if stats is None:
                stats = self.by_direction[result.direction] = DirectionStats()
            stats.jobs += 1
            if result.success:
                stats.bytes += result.num_bytes
                stats.seconds += result.seconds
            else:
                stats.failed_jobs += 1

    def as_dict(self) -> dict[str, float]:
        """Flat counters, e.g. ``{"GPU_to_CPU_bytes": ..., "CPU_to_GPU_seconds": ...}``."""
        out: dict[str, float] = {}
        for (src, dst), stats in sorted(self.by_direction.items()):
            prefix = f"{src or 'unknown'}_to_{dst or 'unknown'}"
            out[f"{prefix}_jobs"] = stats.jobs
            out[f"{prefix}_failed_jobs"] = stats.failed_jobs
            out[f"{prefix}_bytes"] = stats.bytes
            out[f"{prefix}_seconds"] = stats.seconds
        return out
