"""kvoffload: tiered KV-cache offloading for LLM inference.

``import kvoffload`` loads the scheduler-side core (keys, the manager contract, managers and
eviction policies) and imports no torch. Every other headline class is exported here too and
loads on first use: the connector's scheduler side, the tiers (``DiskTier``, ``RedisTier``), the
worker side (``OffloadingConnectorWorker``, torch), the reference engine (``Engine``, torch) and
KV events' ``KVEventsConfig``. Their packages export them as well.
"""

from kvoffload._lazy import lazy_exports
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
from kvoffload.load_store_specs import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.manager_contract import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvoffload.managers import (
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    TieringOffloadingManager,
)

__version__ = "0.1.0"

#: Exported names imported on first use (name -> the package that exports it).
_LAZY = {
    "DiskTier": "kvoffload.tiers",
    "Engine": "kvoffload.engine",
    "EngineConfig": "kvoffload.engine",
    "KVEventsConfig": "kvoffload.events",
    "KVLayout": "kvoffload.tiers",
    "OffloadPolicy": "kvoffload.scheduler",
    "OffloadingConnectorScheduler": "kvoffload.scheduler",
    "OffloadingConnectorWorker": "kvoffload.worker",
    "RedisTier": "kvoffload.tiers",
    "RemoteTierConfig": "kvoffload.tiers",
    "RequestKVState": "kvoffload.scheduler",
    "SamplingParams": "kvoffload.engine",
    "SchedulerOffloadConfig": "kvoffload.scheduler",
    "SecondaryTier": "kvoffload.tiers",
    "StoreOnComputePolicy": "kvoffload.scheduler",
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "ConfigError",
    "ContractError",
    "DiskTier",
    "Engine",
    "EngineConfig",
    "EvictionPolicy",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "HostAllocationError",
    "KVEventsConfig",
    "KVLayout",
    "KVOffloadError",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingConnectorScheduler",
    "OffloadingConnectorWorker",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RedisTier",
    "RemoteTierConfig",
    "ReqContext",
    "RequestKVState",
    "SamplingParams",
    "SchedulerOffloadConfig",
    "SecondaryTier",
    "StoreOnComputePolicy",
    "TieringOffloadingManager",
    "TransferError",
    "__version__",
    "available_eviction_policies",
    "create_eviction_policy",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
]
