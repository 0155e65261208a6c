"""KV cache events over ZMQ, wire-compatible with vLLM, covering every tier (``docs/events.md``).

Producers build :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared` events,
the engine publishes one :class:`KVEventBatch` per step through the publisher that
:func:`create_event_publisher` makes from a :class:`KVEventsConfig`, and routers follow them with
:class:`KVEventSubscriber` and :class:`BlockIndex`. Imports neither torch nor the engine.
"""

from kvoffload._lazy import lazy_exports
from kvoffload.events.block_index import BlockIndex
from kvoffload.events.codec import EventDecodeError, EventDecoder, EventEncoder
from kvoffload.events.config import PUBLISHERS, KVEventsConfig
from kvoffload.events.messages import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    external_block_hash,
    tier_of,
)
from kvoffload.events.protocol import (
    REPLAY_END,
    SEQ_BYTES,
    binds_by_default,
    decode_seq,
    encode_seq,
    exposed_beyond_host,
    offset_endpoint,
    publisher_binds,
)

# The ZMQ side (publisher, subscriber) is imported on first use, so that producers that only need
# the event types (the scheduler-side connector) never load pyzmq.
_LAZY = {
    "EventPublisher": "kvoffload.events.publisher",
    "NullEventPublisher": "kvoffload.events.publisher",
    "PublisherState": "kvoffload.events.publisher",
    "ZmqEventPublisher": "kvoffload.events.publisher",
    "create_event_publisher": "kvoffload.events.publisher",
    "Gap": "kvoffload.events.subscriber",
    "KVEventSubscriber": "kvoffload.events.subscriber",
    "ReceivedBatch": "kvoffload.events.subscriber",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "PUBLISHERS",
    "REPLAY_END",
    "SEQ_BYTES",
    "TIERS",
    "AllBlocksCleared",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "EventDecoder",
    "EventEncoder",
    "EventPublisher",
    "ExternalBlockHash",
    "Gap",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventSubscriber",
    "KVEventsConfig",
    "NullEventPublisher",
    "PublisherState",
    "ReceivedBatch",
    "ZmqEventPublisher",
    "binds_by_default",
    "create_event_publisher",
    "decode_seq",
    "encode_seq",
    "exposed_beyond_host",
    "external_block_hash",
    "offset_endpoint",
    "publisher_binds",
    "tier_of",
]
