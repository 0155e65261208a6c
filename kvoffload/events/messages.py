"""KV cache event types, wire-compatible with vLLM's ``vllm/distributed/kv_events.py``.

Events are msgspec Structs tagged with their class name and encoded with ``omit_defaults``, so
on the wire each event is a map ``{"type": "BlockStored", "block_hashes": [...], ...}`` with the
fields that hold their default left out (vLLM's current form; :mod:`kvoffload.events.codec` also
writes and reads the older positional-array form). Fields without a default are always written,
even when ``None``. Field order is vLLM's; fields of ours come after vLLM's, so positional
consumers see vLLM's layout.

Where a block lives is ``medium`` (:data:`MEDIUM_GPU`, :data:`MEDIUM_CPU`,
:data:`MEDIUM_STORAGE`) plus, for storage, ``locality`` (:data:`LOCALITY_LOCAL` for a disk of this
node, :data:`LOCALITY_REMOTE` for a store shared between nodes). Everything that reads events
names that place with one vocabulary, :data:`TIERS`, through :func:`tier_of`; the wire keeps
medium and locality.

Block hashes on the wire are :data:`ExternalBlockHash` values made by :func:`external_block_hash`
from the hash part of an offload key (``kvoffload.keys.offload_key_hash``); the KV-cache group
travels separately in ``group_idx``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "TIERS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "external_block_hash",
    "tier_of",
]

#: The engine's own device KV cache (whatever the device is).
MEDIUM_GPU = "GPU"
#: The host-memory offloading tier.
MEDIUM_CPU = "CPU"
#: A storage tier; ``locality`` says which one.
MEDIUM_STORAGE = "STORAGE"
#: Storage attached to this node (the disk tier).
LOCALITY_LOCAL = "LOCAL"
#: Storage shared between nodes (the remote store tier).
LOCALITY_REMOTE = "REMOTE"

#: The tiers, fastest first: the engine's device cache, host memory, this node's disk, a store
#: shared between nodes. The one vocabulary of every index and tool that reads events.
TIERS = ("device", "host", "disk", "remote")


def tier_of(medium: str | None, locality: str | None = None) -> str:
    """The tier (one of :data:`TIERS`) of an event's ``medium`` and ``locality``.

    ``GPU`` or no medium (producers older than mediums) is ``device``; ``CPU`` is ``host``;
    ``STORAGE`` with locality ``REMOTE`` is ``remote``; any other storage, and any medium this
    version does not know, is ``disk``.
    """
    if medium is None or medium == MEDIUM_GPU:
        return "device"
    if medium == MEDIUM_CPU:
        return "host"
    if medium == MEDIUM_STORAGE and locality == LOCALITY_REMOTE:
        return "remote"
    return "disk"


#: A block hash as consumers see it: raw hash bytes, or a 64-bit unsigned int (see
#: :func:`external_block_hash`).
ExternalBlockHash: TypeAlias = bytes | int


def external_block_hash(h: bytes, as_int: bool) -> ExternalBlockHash:
    """Return block hash ``h`` as published: ``h`` itself, or its low 8 bytes as an unsigned int.

    ``as_int`` is ``KVEventsConfig.int_block_hashes``. The int form is the last 8 bytes of ``h``
    read big-endian, as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does (llm-d also takes the
    last 8 bytes). Pass the block hash without the group suffix of an offload key.
    """
    return int.from_bytes(h[-8:], "big") if as_int else h


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the event types; the tag (``"type"`` on the wire) is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks became readable in ``medium`` (``locality``).

    ``block_hashes`` are consecutive blocks of one sequence, head first. Self-describing events,
    which every kvoffload producer emits (GPU and offload tiers alike), satisfy
    ``len(token_ids) == len(block_hashes) * block_size``: ``token_ids`` are the tokens of those
    blocks, ``block_size`` is the tokens per reported block, ``parent_block_hash`` is the hash of
    the block before the first one (``None`` when the first block starts the sequence) and
    ``group_idx`` is the KV-cache group. An offloaded block that spans several engine blocks is
    reported as one block: the hash of its last engine block, ``block_size`` = its size in tokens.

    ``lora_id`` is deprecated upstream and kept for compatibility (``None``); ``lora_name`` names
    the adapter, ``None`` for the base model. ``extra_keys``, when set, holds per reported block
    the extra hash inputs (multimodal identifiers, cache salt) or ``None``.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left ``medium`` (``locality``): evicted, or dropped by a reset of that tier."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The engine's device prefix cache was reset (vLLM emits it for the GPU cache only).

    Offload tiers announce resets with :class:`BlockRemoved` events instead.
    """


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step: ``[ts, events, data_parallel_rank]`` on the wire.

    ``ts`` is the wall-clock time (``time.time()``) the batch was built. Publishers stamp
    ``data_parallel_rank`` when it is ``None``.
    """

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
