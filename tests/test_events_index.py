"""BlockIndex: the live per-tier view a router builds from events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.events import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    TIERS,
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    tier_of,
)


def _stored(
    hashes: list, medium: str | None, locality: str | None = None, group: int | None = None
) -> BlockStored:
    return BlockStored(
        hashes, None, [0] * len(hashes), 1, None, medium, None, group_idx=group, locality=locality
    )


def test_one_tier_vocabulary() -> None:
    """The wire's medium and locality name one of TIERS; the events index and the router's
    index use it alike."""
    from kvoffload.routing.prefix_index import DEVICE, DISK, HOST, REMOTE
    from kvoffload.routing.prefix_index import TIERS as ROUTING_TIERS

    assert tier_of(MEDIUM_GPU) == "device"
    assert tier_of(None) == "device"  # producers older than mediums
    assert tier_of(MEDIUM_CPU, None) == "host"
    assert tier_of(MEDIUM_STORAGE, LOCALITY_LOCAL) == "disk"
    assert tier_of(MEDIUM_STORAGE) == "disk"
    assert tier_of(MEDIUM_STORAGE, LOCALITY_REMOTE) == "remote"
    assert tier_of("NVME") == "disk"  # an unknown medium: storage of some kind
    assert ROUTING_TIERS is TIERS
    assert [TIERS[i] for i in (DEVICE, HOST, DISK, REMOTE)] == list(TIERS)


def test_a_prefix_moving_down_the_tiers() -> None:
    index = BlockIndex()
    prefix: list[ExternalBlockHash] = [b"a", b"b", b"c"]
    index.apply(KVEventBatch(0.0, [_stored(prefix, MEDIUM_GPU)]))
    index.apply(
        KVEventBatch(
            1.0, [_stored(prefix[:2], MEDIUM_CPU), _stored(prefix, MEDIUM_STORAGE, LOCALITY_LOCAL)]
        )
    )
    index.apply(KVEventBatch(2.0, [BlockRemoved(prefix, MEDIUM_GPU)]))
    assert index.tiers_of(b"a") == ["host", "disk"]
    assert index.tiers_of(b"c") == ["disk"]
    assert index.prefix_length([*prefix, b"d"], "host") == 2
    assert index.prefix_length(prefix, "disk") == 3
    assert index.prefix_length(prefix, "device") == 0
    assert index.prefix_length(prefix, "remote") == 0
    assert index.counts() == {"device": 0, "host": 2, "disk": 3}
    assert index.blocks("host") == {b"a", b"b"}
    assert index.contains(b"b", "host") and not index.contains(b"c", "host")


def test_groups_are_separate_and_missing_group_is_zero() -> None:
    index = BlockIndex()
    index.apply_event(_stored([7], MEDIUM_CPU, group=1))
    index.apply_event(_stored([7], MEDIUM_CPU))
    index.apply_event(BlockRemoved([7], MEDIUM_CPU, group_idx=0))
    assert index.contains(7, "host", group_idx=1)
    assert not index.contains(7, "host", group_idx=0)
    assert index.counts() == {"host": 1}


def test_all_blocks_cleared_empties_the_device_tier_only_by_default() -> None:
    events: list[KVCacheEvent] = [
        _stored([1], MEDIUM_GPU),
        _stored([1], MEDIUM_CPU),
        AllBlocksCleared(),
    ]
    index = BlockIndex()
    for event in events:
        index.apply_event(event)
    assert index.tiers_of(1) == ["host"]
    everything = BlockIndex(cleared_tiers=None)
    for event in events:
        everything.apply_event(event)
    assert everything.tiers_of(1) == []
    assert everything.counts() == {"device": 0, "host": 0}


def test_removing_unknown_blocks_is_harmless() -> None:
    index = BlockIndex()
    index.apply_event(BlockRemoved([b"x"], MEDIUM_CPU))
    assert index.counts() == {"host": 0}
    index.clear()
    assert index.tiers() == []


_TIERS = [
    (MEDIUM_GPU, None),
    (MEDIUM_CPU, None),
    (MEDIUM_STORAGE, LOCALITY_LOCAL),
    (MEDIUM_STORAGE, LOCALITY_REMOTE),
]
_op: st.SearchStrategy[tuple] = st.one_of(
    st.tuples(
        st.sampled_from(["stored", "removed"]),
        st.sampled_from(_TIERS),
        st.lists(st.integers(0, 12), max_size=5),
        st.sampled_from([None, 0, 1]),
    ),
    st.just(("cleared", None, [], None)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=40), via_wire=st.sampled_from([None, False, True]))
def test_index_matches_a_reference_set(ops: list, via_wire: bool | None) -> None:
    reference: set[tuple[str, int, int]] = set()
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for kind, tier, hashes, group in ops:
        g = 0 if group is None else group
        if kind == "cleared":
            events.append(AllBlocksCleared())
            reference = {entry for entry in reference if entry[0] != "device"}
            continue
        medium, locality = tier
        name = tier_of(medium, locality)
        if kind == "stored":
            events.append(_stored(hashes, medium, locality, group))
            reference |= {(name, g, h) for h in hashes}
        else:
            events.append(BlockRemoved(hashes, medium, group_idx=group, locality=locality))
            reference -= {(name, g, h) for h in hashes}
    batch = KVEventBatch(0.0, events, 0)
    if via_wire is not None:  # through the encoder and decoder, in either form
        batch = EventDecoder().decode(EventEncoder(legacy_array_events=via_wire).encode(batch))
    index = BlockIndex()
    index.apply(batch)
    held = {(name, g, h) for name in index.tiers() for g in (0, 1) for h in index.blocks(name, g)}
    assert held == reference
    assert sum(index.counts().values()) == len(reference)
    for name, g, h in reference:
        assert index.contains(h, name, g)
        assert name in index.tiers_of(h, g)
