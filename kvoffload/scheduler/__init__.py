"""The scheduler side of offloading: per-request KV state, store policies and the connector."""

from kvoffload.scheduler.connector import OffloadingConnectorScheduler, parse_kv_transfer_params
from kvoffload.scheduler.interface import ConnectorUpdate, ScheduledRequest, SchedulerOutput
from kvoffload.scheduler.policy import (
    STORE_POLICIES,
    OffloadPolicy,
    StoreOnComputePolicy,
    StoreOnFinishPolicy,
    StorePromptOnlyPolicy,
    create_store_policy,
)
from kvoffload.scheduler.state import (
    NULL_BLOCK_ID,
    GroupOffloadConfig,
    OffloadRequest,
    RequestGroupState,
    RequestKVState,
    SchedulerOffloadConfig,
)

__all__ = [
    "NULL_BLOCK_ID",
    "STORE_POLICIES",
    "ConnectorUpdate",
    "GroupOffloadConfig",
    "OffloadPolicy",
    "OffloadRequest",
    "OffloadingConnectorScheduler",
    "RequestGroupState",
    "RequestKVState",
    "ScheduledRequest",
    "SchedulerOffloadConfig",
    "SchedulerOutput",
    "StoreOnComputePolicy",
    "StoreOnFinishPolicy",
    "StorePromptOnlyPolicy",
    "create_store_policy",
    "parse_kv_transfer_params",
]
