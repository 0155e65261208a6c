"""``OffloadEventDescriber``: every stored event of a tier describes its block, also when the block
is stored, evicted and planned for storing again before the first stored event is converted
(all within one engine step, with a tier of a few blocks), and descriptions of planned stores do
not outlive them (announced blocks' descriptions are kept only in the bounded recent cache, for a
cascade to a further tier)."""

from __future__ import annotations

from kvoffload.events import BlockStored
from kvoffload.keys import make_offload_key
from kvoffload.manager_contract import OffloadingEvent
from kvoffload.scheduler.events import OffloadEventDescriber

KEY = make_offload_key(bytes(32), 0)
TOKENS = [1, 2, 3, 4]


def _stored() -> OffloadingEvent:
    return OffloadingEvent([KEY], "CPU", False)


def test_a_key_planned_again_before_its_stored_event_is_described_each_time() -> None:
    describer = OffloadEventDescriber()
    describer.record(KEY, None, TOKENS, 4)  # store 1 planned
    describer.record(KEY, None, TOKENS, 4)  # stored, evicted, store 2 planned: same step
    events = describer.convert([_stored(), OffloadingEvent([KEY], "CPU", True)])
    events += describer.convert([_stored()])  # store 2 completes a step later
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.token_ids, e.block_size) for e in stored] == [(TOKENS, 4), (TOKENS, 4)]
    assert not describer._pending  # nothing left over in flight: bounded by the stores planned


def test_a_failed_store_forgets_one_description() -> None:
    describer = OffloadEventDescriber()
    describer.record(KEY, None, TOKENS, 4)
    describer.record(KEY, None, TOKENS, 4)
    describer.forget([KEY])  # store 2 failed
    (event,) = describer.convert([_stored()])
    assert isinstance(event, BlockStored) and event.token_ids == TOKENS
    assert not describer._pending  # both planned stores accounted for
    describer.forget([KEY])  # nothing planned: ignored
    assert not describer._pending
