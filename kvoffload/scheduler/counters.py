"""What the scheduler-side connector counts, and the stats it reports from them.

:class:`ConnectorCounters` holds the counters the connector and its planners add to (the
planners are handed :attr:`~ConnectorCounters.counts` and
:attr:`~ConnectorCounters.hit_tokens_by_source`), the transfer bytes and seconds the workers
report, and the hit tokens whose load failed, by tier. Plain dict additions: O(1) per event.
"""

from __future__ import annotations

from kvoffload.scheduler.jobs import PlannedJob
from kvoffload.transfer import TransferResult

__all__ = ["COUNTER_NAMES", "ConnectorCounters"]

#: The connector's counters (the meanings: :meth:`ConnectorCounters.stats`).
COUNTER_NAMES = (
    "lookups",
    "retries",
    "retry_timeouts",
    "hit_tokens",
    "load_jobs",
    "loaded_blocks",
    "failed_loads",
    "store_jobs",
    "stored_blocks",
    "failed_stores",
    "rejected_stores",
    "shed_store_blocks",
    "load_bytes",
    "store_bytes",
)


class ConnectorCounters:
    """The connector's counters (module docstring)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        #: hit_tokens split by load source (the planners add to it)
        self.hit_tokens_by_source: dict[str, int] = {}
        #: the part of hit_tokens_by_source whose load failed (recomputed)
        self.failed_load_tokens_by_source: dict[str, int] = {}
        self._transfer_seconds = {"load": 0.0, "store": 0.0}

    def result(self, job: PlannedJob, result: TransferResult) -> None:
        """A worker reported ``result`` for ``job``: its bytes and seconds."""
        direction = "store" if job.is_store else "load"
        self.counts[f"{direction}_bytes"] += result.num_bytes
        self._transfer_seconds[direction] += result.seconds

    def completed(self, job: PlannedJob, failed: bool) -> None:
        """Every worker reported ``job``; ``failed``: it failed or went stale in a reset (a
        stale job is not counted as a failure, but its load's tokens were recomputed)."""
        counts = self.counts
        if not failed:
            counts["stored_blocks" if job.is_store else "loaded_blocks"] += len(job.keys)
            return
        if not job.is_store:
            by_source = self.failed_load_tokens_by_source
            for source, n in job.sources.items():
                by_source[source] = by_source.get(source, 0) + n
        if job.failed:
            counts["failed_stores" if job.is_store else "failed_loads"] += 1

    def stats(self) -> dict[str, float]:
        """The counters as stats.

        ``lookups``: calls of get_num_new_matched_tokens, retries included; ``hit_tokens``:
        tokens whose load was planned, split by tier as ``hit_tokens_<tier>``, and
        ``failed_load_tokens_<tier>`` of those whose load failed and were recomputed;
        ``load_jobs`` / ``store_jobs``: jobs planned; ``loaded_blocks`` / ``stored_blocks``:
        blocks of jobs that completed successfully (loaded into the engine, stored in the
        tier); ``failed_loads`` / ``failed_stores``: jobs that failed; ``shed_store_blocks``:
        offered blocks shed because ``max_stores_in_flight`` were in flight; bytes
        (``load_bytes``, ``store_bytes``) and seconds (``load_seconds``, ``store_seconds``) as
        the workers reported them.
        """
        out: dict[str, float] = dict(self.counts)
        for source, n in self.hit_tokens_by_source.items():
            out[f"hit_tokens_{source}"] = n
        for source, n in self.failed_load_tokens_by_source.items():
            out[f"failed_load_tokens_{source}"] = n
        out["load_seconds"] = self._transfer_seconds["load"]
        out["store_seconds"] = self._transfer_seconds["store"]
        return out
