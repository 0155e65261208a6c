"""msgpack encoding of :class:`~kvoffload.events.messages.KVEventBatch`, in both wire forms.

The batch is always a positional array ``[ts, events, data_parallel_rank]``. Events are either

* maps (default, vLLM since #42892): ``{"type": "BlockStored", "block_hashes": ..., ...}``,
  fields holding their default left out; or
* legacy positional arrays (``legacy_array_events``): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
  locality]`` with trailing fields that hold their default left out, so an event that sets none
  of the later fields has exactly the length older consumers expect. msgspec ignores
  ``omit_defaults`` for ``array_like`` structs (msgspec#720), so this form is built by hand.

:class:`EventDecoder` reads both forms, and batches that mix them. Unknown map keys and extra
trailing array elements (fields a newer producer added) are ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvoffload.errors import KVOffloadError
from kvoffload.events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["EventDecodeError", "EventDecoder", "EventEncoder"]

_EVENT_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)


class EventDecodeError(KVOffloadError, ValueError):
    """A payload is not a KV event batch in either wire form."""


# Array-like twins of the event types, used only to decode the legacy form.
class _LegacyBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _LegacyBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _LegacyAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_LegacyEvent = _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared
_Event = BlockStored | BlockRemoved | AllBlocksCleared


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LegacyEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_PUBLIC_TYPE: dict[type, type[_Event]] = {
    _LegacyBlockStored: BlockStored,
    _LegacyBlockRemoved: BlockRemoved,
    _LegacyAllBlocksCleared: AllBlocksCleared,
}


def _from_legacy(event: KVCacheEvent) -> _Event:
    return _PUBLIC_TYPE[type(event)](*msgspec.structs.astuple(event))


# type -> (tag, number of fields without a default). Every defaulted event field defaults to
# None (a test pins this), so "trailing defaults" are trailing Nones: `is None` is much cheaper
# than comparing with each field's default.
_LEGACY_LAYOUT = {
    cls: (cls.__name__, len(cls.__struct_fields__) - len(cls.__struct_defaults__))
    for cls in _EVENT_TYPES
}


def _to_legacy(event: KVCacheEvent) -> tuple[Any, ...]:
    tag, required = _LEGACY_LAYOUT[type(event)]
    values = (tag, *msgspec.structs.astuple(event))
    n = len(values)
    while n > required + 1 and values[n - 1] is None:
        n -= 1
    return values[:n]


class EventEncoder:
    """Encodes batches in the map form, or the legacy array form when ``legacy_array_events``.

    Not thread-safe: give each thread its own encoder.
    """

    __slots__ = ("_encoder", "legacy_array_events")

    def __init__(self, legacy_array_events: bool = False) -> None:
        self.legacy_array_events = legacy_array_events
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: KVEventBatch) -> bytes:
        """Return the msgpack bytes of ``batch``."""
        if not self.legacy_array_events:
            return self._encoder.encode(batch)
        events = [_to_legacy(e) for e in batch.events]
        return self._encoder.encode((batch.ts, events, batch.data_parallel_rank))


class EventDecoder:
    """Decodes batches in either wire form into the public event types.

    Raises :class:`EventDecodeError` for anything else. Not thread-safe.
    """

    __slots__ = ("_legacy", "_map", "_raw")

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(KVEventBatch)
        self._legacy = msgspec.msgpack.Decoder(_LegacyBatch)
        self._raw = msgspec.msgpack.Decoder(_RawBatch)

    def decode(self, payload: bytes | memoryview) -> KVEventBatch:
        """Return the batch encoded in ``payload``."""
        try:
            return self._map.decode(payload)
        except msgspec.DecodeError as map_exc:
            first_error = map_exc
        try:
            legacy = self._legacy.decode(payload)
            events = [_from_legacy(e) for e in legacy.events]
            return KVEventBatch(legacy.ts, events, legacy.data_parallel_rank)
        except msgspec.DecodeError:
            pass
        try:
            raw = self._raw.decode(payload)
            events = [self._convert_event(e) for e in raw.events]
        except msgspec.DecodeError as exc:
            # The map-form message says most about what was wrong with the payload.
            raise EventDecodeError(f"not a KV event batch: {first_error}") from exc
        return KVEventBatch(raw.ts, events, raw.data_parallel_rank)

    @staticmethod
    def _convert_event(event: Any) -> _Event:
        if isinstance(event, list):
            return _from_legacy(msgspec.convert(event, _LegacyEvent))
        return msgspec.convert(event, _Event)
