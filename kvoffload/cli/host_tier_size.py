"""``kvoffload serve``'s default host tier, sized from the machine: a quarter of the memory
available when it starts (``MemAvailable``), at most 16 GiB, rounded down to 1/4 GiB; none where
that is under 1/4 GiB or the available memory cannot be read. ``--kv-offloading-size`` sets
the size; 0 turns the tier off. On CPU the host pool's pages are reserved, not touched, at start
(the tier takes memory as it fills); with a CUDA device the pool is page-locked at start, so its
whole size is taken then."""

from __future__ import annotations

import os

from kvoffload.cli.flagspec import MachineDefault

__all__ = ["HOST_TIER_DEFAULT", "MAX_GIB", "auto_host_tier_gib", "available_memory_bytes"]

MAX_GIB = 16.0
_SHARE = 4  # a quarter
_STEP_GIB = 0.25
_MEMINFO = "/proc/meminfo"


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), else free physical pages; ``None`` where
    neither can be read."""
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def auto_host_tier_gib(available: int | None = None) -> float:
    """The rule above for ``available`` bytes (default: this machine's, now)."""
    if available is None:
        available = available_memory_bytes()
    if available is None:
        return 0.0
    gib = min(available / 2**30 / _SHARE, MAX_GIB)
    return int(gib / _STEP_GIB) * _STEP_GIB


HOST_TIER_DEFAULT = MachineDefault(
    f"auto: a quarter of the available memory, at most {MAX_GIB:g} GiB", auto_host_tier_gib
)
