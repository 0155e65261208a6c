"""Deprecated path: the Redis tier moved to :mod:`kvoffload.tiers.redis.tier` (this one forwards,
with a warning; ``kvoffload.tiers.RedisTier`` is the public name)."""

from kvoffload._lazy import moved_module

__getattr__ = moved_module(__name__, "kvoffload.tiers.redis.tier")
