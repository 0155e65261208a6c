"""Deprecated path: the manager contract moved to :mod:`kvoffload.manager_contract` (this one forwards, with a warning)."""

from kvoffload._lazy import moved_module

__getattr__ = moved_module(__name__, "kvoffload.manager_contract")
