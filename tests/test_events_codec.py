"""Event types and their two msgpack wire forms: round trips, golden bytes, tolerant decoding."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.events import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    KVEventBatch,
    external_block_hash,
)
from kvoffload.keys import make_offload_key, offload_key_group, offload_key_hash

MAP = EventEncoder(legacy_array_events=False)
LEGACY = EventEncoder(legacy_array_events=True)
DECODER = EventDecoder()


def test_block_stored_field_order_is_vllms_then_ours() -> None:
    assert BlockStored.__struct_fields__ == (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "locality",
    )
    assert BlockRemoved.__struct_fields__ == ("block_hashes", "medium", "group_idx", "locality")
    assert AllBlocksCleared.__struct_fields__ == ()
    assert KVEventBatch.__struct_fields__ == ("ts", "events", "data_parallel_rank")


def test_every_defaulted_field_defaults_to_none() -> None:
    # The legacy encoder drops trailing Nones as "trailing defaults": this must stay true.
    for cls in (BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch):
        assert all(default is None for default in cls.__struct_defaults__), cls


def test_medium_names_are_vllms() -> None:
    assert (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE) == ("GPU", "CPU", "STORAGE")
    assert (LOCALITY_LOCAL, LOCALITY_REMOTE) == ("LOCAL", "REMOTE")


# -- golden messages -------------------------------------------------------------------------------

GOLDEN_BATCH = KVEventBatch(
    ts=1.5,
    events=[
        BlockStored(
            block_hashes=[b"\xab\xcd"],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=1,
        ),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
    ],
    data_parallel_rank=0,
)

# Written out by hand from the msgpack spec: fixarray 0x90|n, fixmap 0x80|n, fixstr 0xa0|len,
# float64 0xcb + 8 bytes, bin8 0xc4 + length byte, nil 0xc0, positive fixint 0x00-0x7f.
# One line per byte group; in maps, each line is a key (a fixstr) followed by its value.
_BATCH_HEAD = [
    b"\x93",  # the batch: fixarray of 3 = [ts, events, data_parallel_rank]
    b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00",  # ts: float64 1.5 (exponent 0x3ff, mantissa .1)
    b"\x93",  # events: fixarray of 3
]
_BATCH_TAIL = [b"\x00"]  # data_parallel_rank: fixint 0

GOLDEN_MAP = b"".join(
    [
        *_BATCH_HEAD,
        # BlockStored: fixmap of 9 = the tag, the 7 fields without a default (written even when
        # None) and group_idx (set); extra_keys and locality hold their default: left out.
        b"\x89",
        b"\xa4type\xabBlockStored",  # "type" (4 chars) -> "BlockStored" (11 chars)
        b"\xacblock_hashes\x91\xc4\x02\xab\xcd",  # -> [bin8 of 2 bytes: ab cd]
        b"\xb1parent_block_hash\xc0",  # (17 chars) -> nil
        b"\xa9token_ids\x92\x01\x02",  # -> [1, 2]
        b"\xaablock_size\x02",
        b"\xa7lora_id\xc0",
        b"\xa6medium\xa3CPU",
        b"\xa9lora_name\xc0",
        b"\xa9group_idx\x01",
        # BlockRemoved: fixmap of 3 = the tag, block_hashes, medium.
        b"\x83",
        b"\xa4type\xacBlockRemoved",
        b"\xacblock_hashes\x91\x07",  # -> [7], an int hash
        b"\xa6medium\xa3GPU",
        # AllBlocksCleared: fixmap of 1, the tag only.
        b"\x81",
        b"\xa4type\xb0AllBlocksCleared",
        *_BATCH_TAIL,
    ]
)

GOLDEN_LEGACY = b"".join(
    [
        *_BATCH_HEAD,
        # BlockStored: fixarray of 10 = the tag, the 7 fields without a default, extra_keys (nil,
        # written because group_idx follows) and group_idx; the trailing locality is left out.
        b"\x9a",
        b"\xabBlockStored",
        b"\x91\xc4\x02\xab\xcd",  # block_hashes
        b"\xc0",  # parent_block_hash
        b"\x92\x01\x02",  # token_ids
        b"\x02",  # block_size
        b"\xc0",  # lora_id
        b"\xa3CPU",  # medium
        b"\xc0",  # lora_name
        b"\xc0",  # extra_keys
        b"\x01",  # group_idx
        # BlockRemoved: fixarray of 3 = the tag, block_hashes, medium.
        b"\x93",
        b"\xacBlockRemoved",
        b"\x91\x07",  # block_hashes
        b"\xa3GPU",  # medium
        # AllBlocksCleared: fixarray of 1, the tag.
        b"\x91",
        b"\xb0AllBlocksCleared",
        *_BATCH_TAIL,
    ]
)


def test_map_form_matches_golden_bytes() -> None:
    assert MAP.encode(GOLDEN_BATCH) == GOLDEN_MAP
    assert DECODER.decode(GOLDEN_MAP) == GOLDEN_BATCH


def test_legacy_form_matches_golden_bytes() -> None:
    assert LEGACY.encode(GOLDEN_BATCH) == GOLDEN_LEGACY
    assert DECODER.decode(GOLDEN_LEGACY) == GOLDEN_BATCH


def test_legacy_event_without_later_fields_has_the_original_length() -> None:
    event = BlockStored([b"h"], None, [1], 1, None, "CPU", None)
    (_, events, _) = msgspec.msgpack.decode(LEGACY.encode(KVEventBatch(0.0, [event], 0)))
    assert events[0] == ["BlockStored", [b"h"], None, [1], 1, None, "CPU", None]


def test_legacy_locality_alone_keeps_placeholders_before_it() -> None:
    event = BlockRemoved([1], MEDIUM_STORAGE, locality=LOCALITY_REMOTE)
    (_, events, _) = msgspec.msgpack.decode(LEGACY.encode(KVEventBatch(0.0, [event], 0)))
    assert events[0] == ["BlockRemoved", [1], "STORAGE", None, "REMOTE"]


# -- round trips -----------------------------------------------------------------------------------

_hash = st.one_of(st.binary(min_size=1, max_size=32), st.integers(min_value=0, max_value=2**64 - 1))
_opt_str = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "LOCAL", "REMOTE", "lora-a"])
_opt_int = st.none() | st.integers(min_value=0, max_value=2**31)
_extra = st.none() | st.lists(
    st.none() | st.tuples(st.text(max_size=5), st.integers(-5, 5)), max_size=3
)

_stored = st.builds(
    BlockStored,
    block_hashes=st.lists(_hash, max_size=4),
    parent_block_hash=st.none() | _hash,
    token_ids=st.lists(st.integers(0, 2**31), max_size=20),
    block_size=st.integers(0, 256),
    lora_id=_opt_int,
    medium=_opt_str,
    lora_name=_opt_str,
    extra_keys=_extra,
    group_idx=_opt_int,
    locality=_opt_str,
)
_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(_hash, max_size=4),
    medium=_opt_str,
    group_idx=_opt_int,
    locality=_opt_str,
)
_batch = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(_stored, _removed, st.just(AllBlocksCleared())), max_size=6),
    data_parallel_rank=_opt_int,
)


@settings(max_examples=150, deadline=None)
@given(batch=_batch, legacy=st.booleans())
def test_every_event_round_trips_in_both_forms(batch: KVEventBatch, legacy: bool) -> None:
    encoder = LEGACY if legacy else MAP
    assert DECODER.decode(encoder.encode(batch)) == batch


def test_fully_populated_events_round_trip() -> None:
    stored = BlockStored(
        block_hashes=[b"\x01" * 32, 2**64 - 1],
        parent_block_hash=b"\x00" * 32,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=3,
        medium=MEDIUM_STORAGE,
        lora_name="adapter",
        extra_keys=[("img", 42), None],
        group_idx=2,
        locality=LOCALITY_LOCAL,
    )
    removed = BlockRemoved([5, 6], MEDIUM_CPU, group_idx=1, locality=None)
    batch = KVEventBatch(math.pi, [stored, removed, AllBlocksCleared()], 3)
    for encoder in (MAP, LEGACY):
        assert DECODER.decode(encoder.encode(batch)) == batch


# -- tolerant decoding -----------------------------------------------------------------------------


def test_decoder_ignores_fields_a_newer_producer_added() -> None:
    newer_map = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [9],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "kv_cache_spec_kind": "full_attention",
        "session_id": "s",
    }
    newer_array = ["BlockRemoved", [1], "GPU", 0, None, "primary", "extra"]
    for event in (newer_map, newer_array):
        batch = DECODER.decode(msgspec.msgpack.encode([2.0, [event], 1]))
        assert batch.ts == 2.0 and batch.data_parallel_rank == 1
    (stored,) = DECODER.decode(msgspec.msgpack.encode([2.0, [newer_map], 1])).events
    assert isinstance(stored, BlockStored) and stored.token_ids == [9]


def test_decoder_reads_vllm_legacy_arrays_with_every_trailing_field_written() -> None:
    # msgspec ignores omit_defaults for array_like structs, so vLLM wrote trailing nils.
    event = ["BlockStored", [b"h"], None, [1, 2], 2, None, "GPU", None, None, None]
    batch = DECODER.decode(msgspec.msgpack.encode([0.5, [event], None]))
    assert batch == KVEventBatch(
        0.5, [BlockStored([b"h"], None, [1, 2], 2, None, "GPU", None)], None
    )


def test_decoder_reads_a_batch_mixing_both_forms() -> None:
    events = msgspec.msgpack.decode(MAP.encode(GOLDEN_BATCH))[1]
    legacy_events = msgspec.msgpack.decode(LEGACY.encode(GOLDEN_BATCH))[1]
    mixed = [legacy_events[0], events[1], legacy_events[2]]
    assert DECODER.decode(msgspec.msgpack.encode([1.5, mixed, 0])) == GOLDEN_BATCH


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"ts": 1.0}),  # a map, not the positional batch
        msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}], 0]),  # unknown event type
        msgspec.msgpack.encode([1.0, [["BlockRemoved"]], 0]),  # required fields missing
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockRemoved", "block_hashes": "x", "medium": None}], 0]
        ),
    ],
)
def test_decoder_rejects_what_is_not_a_batch(payload: bytes) -> None:
    with pytest.raises(EventDecodeError, match="not a KV event batch"):
        DECODER.decode(payload)


# -- block hashes ----------------------------------------------------------------------------------


def test_external_block_hash_bytes_or_low_64_bits() -> None:
    h = bytes(range(32))
    assert external_block_hash(h, as_int=False) is h
    assert external_block_hash(h, as_int=True) == 0x18191A1B1C1D1E1F  # bytes 24..31, big-endian
    assert external_block_hash(b"\xff" * 32, as_int=True) == 2**64 - 1  # unsigned


def test_group_index_is_not_part_of_the_published_hash() -> None:
    h = bytes(range(32))
    keys = [make_offload_key(h, group) for group in (0, 1, 7)]
    published = {external_block_hash(offload_key_hash(k), as_int=True) for k in keys}
    assert published == {0x18191A1B1C1D1E1F}
    assert [offload_key_group(k) for k in keys] == [0, 1, 7]
