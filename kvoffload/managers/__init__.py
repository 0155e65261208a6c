"""Offloading managers: the tiers' scheduler-side bookkeeping."""

from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.reuse import FilterReusedOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager

__all__ = ["CPUOffloadingManager", "FilterReusedOffloadingManager", "TieringOffloadingManager"]
