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
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    KVCacheEvent,
    KVEventBatch,
    tier_name,
)


def _stored(
    hashes: list, medium: str | None, locality: str | None = None, group: int | None = None
) -> BlockStored:
    return BlockStored(
        hashes, None, [0] * len(hashes), 1, None, medium, None, group_idx=group, locality=locality
    )


def test_tier_names() -> None:
    assert tier_name(MEDIUM_GPU) == "GPU"
    assert tier_name(MEDIUM_CPU, None) == "CPU"
    assert tier_name(MEDIUM_STORAGE, LOCALITY_LOCAL) == "STORAGE/LOCAL"
    assert tier_name(MEDIUM_STORAGE, LOCALITY_REMOTE) == "STORAGE/REMOTE"
    assert tier_name(None) == "GPU"


def test_a_prefix_moving_down_the_tiers() -> None:
    index = BlockIndex()
    prefix = [b"a", b"b", b"c"]
    index.apply(KVEventBatch(0.0, [_stored(prefix, MEDIUM_GPU)]))
    index.apply(
        KVEventBatch(
            1.0, [_stored(prefix[:2], MEDIUM_CPU), _stored(prefix, MEDIUM_STORAGE, LOCALITY_LOCAL)]
        )
    )
    index.apply(KVEventBatch(2.0, [BlockRemoved(prefix, MEDIUM_GPU)]))
    assert index.tiers_of(b"a") == ["CPU", "STORAGE/LOCAL"]
    assert index.tiers_of(b"c") == ["STORAGE/LOCAL"]
    assert index.prefix_length([*prefix, b"d"], "CPU") == 2
    assert index.prefix_length(prefix, "STORAGE/LOCAL") == 3
    assert index.prefix_length(prefix, "GPU") == 0
    assert index.prefix_length(prefix, "STORAGE/REMOTE") == 0
    assert index.counts() == {"GPU": 0, "CPU": 2, "STORAGE/LOCAL": 3}
    assert index.blocks("CPU") == {b"a", b"b"}
    assert index.contains(b"b", "CPU") and not index.contains(b"c", "CPU")


def test_groups_are_separate_and_missing_group_is_zero() -> None:
    index = BlockIndex()
    index.apply_event(_stored([7], MEDIUM_CPU, group=1))
    index.apply_event(_stored([7], MEDIUM_CPU))
    index.apply_event(BlockRemoved([7], MEDIUM_CPU, group_idx=0))
    assert index.contains(7, "CPU", group_idx=1)
    assert not index.contains(7, "CPU", group_idx=0)
    assert index.counts() == {"CPU": 1}


def test_all_blocks_cleared_empties_the_device_tier_only_by_default() -> None:
    events: list[KVCacheEvent] = [
        _stored([1], MEDIUM_GPU),
        _stored([1], MEDIUM_CPU),
        AllBlocksCleared(),
    ]
    index = BlockIndex()
    for event in events:
        index.apply_event(event)
    assert index.tiers_of(1) == ["CPU"]
    everything = BlockIndex(cleared_tiers=None)
    for event in events:
        everything.apply_event(event)
    assert everything.tiers_of(1) == []
    assert everything.counts() == {"GPU": 0, "CPU": 0}


def test_removing_unknown_blocks_is_harmless() -> None:
    index = BlockIndex()
    index.apply_event(BlockRemoved([b"x"], MEDIUM_CPU))
    assert index.counts() == {"CPU": 0}
    index.clear()
    assert index.tiers() == []


_TIERS = [
    (MEDIUM_GPU, None),
    (MEDIUM_CPU, None),
    (MEDIUM_STORAGE, LOCALITY_LOCAL),
    (MEDIUM_STORAGE, LOCALITY_REMOTE),
]
_op = st.one_of(
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
    events: list[KVCacheEvent] = []
    for kind, tier, hashes, group in ops:
        g = 0 if group is None else group
        if kind == "cleared":
            events.append(AllBlocksCleared())
            reference = {entry for entry in reference if entry[0] != "GPU"}
            continue
        medium, locality = tier
        name = tier_name(medium, locality)
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
