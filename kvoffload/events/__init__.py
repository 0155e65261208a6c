"""KV cache events over ZMQ, wire-compatible with vLLM, covering every tier (``docs/events.md``).

Producers build :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared` events,
the engine publishes one :class:`KVEventBatch` per step through the publisher that
:func:`create_event_publisher` makes from a :class:`KVEventsConfig`, and routers follow them with
:class:`KVEventSubscriber` and :class:`BlockIndex`. Imports neither torch nor the engine.
"""

from kvoffload.events.codec import EventDecodeError, EventDecoder, EventEncoder
from kvoffload.events.config import PUBLISHERS, KVEventsConfig
from kvoffload.events.index import BlockIndex, tier_name
from kvoffload.events.messages import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    external_block_hash,
)
from kvoffload.events.protocol import (
    REPLAY_END,
    SEQ_BYTES,
    decode_seq,
    encode_seq,
    offset_endpoint,
    publisher_binds,
)
from kvoffload.events.publisher import (
    EventPublisher,
    NullEventPublisher,
    PublisherState,
    ZmqEventPublisher,
    create_event_publisher,
)
from kvoffload.events.subscriber import Gap, KVEventSubscriber, ReceivedBatch

__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "PUBLISHERS",
    "REPLAY_END",
    "SEQ_BYTES",
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
    "create_event_publisher",
    "decode_seq",
    "encode_seq",
    "external_block_hash",
    "offset_endpoint",
    "publisher_binds",
    "tier_name",
]
