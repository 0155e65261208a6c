"""Eviction policies for offloading tiers, registered by name (``--eviction-policy``)."""

from kvoffload.eviction.base import (
    ENTRY_POINT_GROUP,
    EvictionPolicy,
    OffloadedBlock,
    available_eviction_policies,
    create_eviction_policy,
    register_eviction_policy,
)
from kvoffload.eviction.lru import LRUPolicy

__all__ = [
    "ENTRY_POINT_GROUP",
    "EvictionPolicy",
    "LRUPolicy",
    "OffloadedBlock",
    "available_eviction_policies",
    "create_eviction_policy",
    "register_eviction_policy",
]
