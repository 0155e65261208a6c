"""Deprecated path: the load/store specs moved to :mod:`kvoffload.load_store_specs` (this one forwards, with a warning)."""

from kvoffload._lazy import moved_module

__getattr__ = moved_module(__name__, "kvoffload.load_store_specs")
