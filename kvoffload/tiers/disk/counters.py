"""The disk tier's event counts, as its ``stats()`` names them."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["FAILURE_CAUSES", "counter_stats"]

#: Why a block's load or store failed (``failed_load_<cause>``, ``failed_store_<cause>``).
FAILURE_CAUSES = ("missing", "checksum", "corrupt", "layout", "io", "timeout", "full")
_COUNTERS = (
    "filesystem_full_stores",
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "failed_load_blocks",
    "failed_store_blocks",
    "rejected_stores",
    "scanned_blocks",
    "discovered_blocks",
)


def counter_stats(counters: Mapping[str, int]) -> dict[str, int]:
    """Every counter the tier reports, 0 where ``counters`` has none, in a stable order."""
    out = {name: counters.get(name, 0) for name in _COUNTERS}
    for cause in FAILURE_CAUSES:
        out[f"failed_load_{cause}"] = counters.get(f"failed_load_{cause}", 0)
        out[f"failed_store_{cause}"] = counters.get(f"failed_store_{cause}", 0)
    return out
