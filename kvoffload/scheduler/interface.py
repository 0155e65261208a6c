"""What an engine hands the scheduler-side connector each step, and what it gets back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.scheduler.state import OffloadRequest

__all__ = ["ConnectorUpdate", "ScheduledRequest", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledRequest:
    """One request the engine runs this step.

    ``new_block_ids[g]``: engine blocks of group ``g`` allocated to the request since the connector
    last saw its block table, in order (appended to it). ``update_state_after_alloc`` already
    received the whole table of a newly admitted request, so its first ``ScheduledRequest``
    carries no ids (unlike vLLM's ``NewRequestData``, which repeats them); when ``resumed`` is
    set, the ids replace the table instead. ``request.num_computed_tokens`` must still be the
    count *before* this step; ``num_scheduled_tokens`` are computed by this step's forward pass.
    """

    request: OffloadRequest
    num_scheduled_tokens: int
    new_block_ids: Sequence[Sequence[int]] = ()
    resumed: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step as the connector sees it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorUpdate:
    """What the engine must act on after :meth:`update_connector_output`.

    ``loaded``: requests whose load finished; they may run. ``failed_loads``: requests whose load
    failed: their tokens beyond the engine's own prefix-cache hit must be recomputed and the
    loaded engine blocks' contents discarded (never cached). ``freed``: finished requests whose
    engine blocks the engine kept (``request_finished`` said so) and may now free.
    """

    loaded: list[str] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
