"""Eviction policies for offloading tiers, registered by name (``--eviction-policy``)."""

from kvoffload.eviction._request_state import RequestUses
from kvoffload.eviction.adaptive import AdaptivePolicy
from kvoffload.eviction.arc import ARCPolicy
from kvoffload.eviction.base import (
    ENTRY_POINT_GROUP,
    EvictionPolicy,
    HeldBlocksPolicy,
    OffloadedBlock,
    available_eviction_policies,
    create_eviction_policy,
    register_eviction_policy,
)
from kvoffload.eviction.lru import LRUPolicy
from kvoffload.eviction.prefix import PrefixPolicy
from kvoffload.eviction.s3fifo import S3FIFOPolicy

__all__ = [
    "ENTRY_POINT_GROUP",
    "ARCPolicy",
    "AdaptivePolicy",
    "EvictionPolicy",
    "HeldBlocksPolicy",
    "LRUPolicy",
    "OffloadedBlock",
    "PrefixPolicy",
    "RequestUses",
    "S3FIFOPolicy",
    "available_eviction_policies",
    "create_eviction_policy",
    "register_eviction_policy",
]
