"""kvoffload: tiered KV-cache offloading for LLM inference.

The top-level package holds the scheduler-side core (keys, the manager contract, tiers and
eviction policies) and imports no torch. The worker side (``kvoffload.worker``), the reference
engine (``kvoffload.engine``) and KV events (``kvoffload.events``) are imported explicitly.
"""

from kvoffload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvoffload.errors import (
    ConfigError,
    ContractError,
    HostAllocationError,
    KVOffloadError,
    TransferError,
)
from kvoffload.eviction import EvictionPolicy, available_eviction_policies, create_eviction_policy
from kvoffload.keys import (
    BlockHash,
    BlockHasher,
    OffloadKey,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
)
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec

__version__ = "0.1.0"

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "ConfigError",
    "ContractError",
    "EvictionPolicy",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "HostAllocationError",
    "KVOffloadError",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "TieringOffloadingManager",
    "TransferError",
    "__version__",
    "available_eviction_policies",
    "create_eviction_policy",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
]
