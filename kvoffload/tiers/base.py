"""Deprecated path: the tier contract moved to :mod:`kvoffload.tiers.contract` (this one forwards,
with a warning)."""

from kvoffload._lazy import moved_module

__getattr__ = moved_module(__name__, "kvoffload.tiers.contract")
