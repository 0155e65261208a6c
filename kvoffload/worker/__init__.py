"""The worker side: moves KV blocks between the engine's cache and the host tier.

Imports torch (the scheduler-side core never imports this package). The engine uses
:class:`OffloadingConnectorWorker`; :func:`num_host_blocks` sizes the scheduler's
``CPUOffloadingManager`` from a byte budget.
"""

from kvoffload.worker.connector import OffloadingConnectorWorker, default_copy_threads
from kvoffload.worker.cpu_copy import CopyPlanner, CPUCopyHandler
from kvoffload.worker.delays import DelayedCompletionHandler
from kvoffload.worker.faults import FaultInjectingHandler
from kvoffload.worker.handler import OffloadingHandler, OffloadingWorker, TransferSpec, WorkerState
from kvoffload.worker.host_pool import HostPool, num_host_blocks
from kvoffload.worker.layout import GroupLayout, KVCacheLayout, PageView
from kvoffload.worker.mapping import BlockMapping, GroupMapping
from kvoffload.worker.stats import DirectionStats, TransferStats
from kvoffload.worker.torch_copy import TorchCopyHandler

__all__ = [
    "BlockMapping",
    "CPUCopyHandler",
    "CopyPlanner",
    "DelayedCompletionHandler",
    "DirectionStats",
    "FaultInjectingHandler",
    "GroupLayout",
    "GroupMapping",
    "HostPool",
    "KVCacheLayout",
    "OffloadingConnectorWorker",
    "OffloadingHandler",
    "OffloadingWorker",
    "PageView",
    "TorchCopyHandler",
    "TransferSpec",
    "TransferStats",
    "WorkerState",
    "default_copy_threads",
    "num_host_blocks",
]
