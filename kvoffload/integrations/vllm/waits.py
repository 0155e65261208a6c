"""How long vLLM's requests wait on our lookups, against how long an engine step takes.

A lookup that answers ``RETRY`` or ``HIT_PENDING`` (a promotion from a secondary tier, or a store
still being written) makes vLLM ask again at a later step; the request waits meanwhile.
:class:`LookupWaits` times each such wait, per request and key, from the first non-final answer
to the final one (``HIT`` or ``MISS``), in seconds and in scheduler steps, and times the engine's
steps while it holds requests (``on_schedule_end`` to ``on_schedule_end``, both ends with a
request in the engine: prefill and decode steps alike, never an idle gap). ``summary()`` gives
count, p50, p90 and max of each: the figures ``make bench-vllm`` reports.

Per-lookup work is one dict lookup on the request's own state; the samples are kept in bounded
deques (the last :data:`MAX_SAMPLES` of each), which ``summary()`` sorts: call it seldom.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

__all__ = ["MAX_SAMPLES", "LookupWaits"]

MAX_SAMPLES = 10_000


class _Pending(dict):
    """key -> (monotonic time, step) of its first non-final answer, on the request's context."""


def _quantiles(samples: deque[float]) -> dict[str, float]:
    if not samples:
        return {"count": 0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    ordered = sorted(samples)
    n = len(ordered)
    return {
        "count": n,
        "p50": ordered[(n - 1) // 2],
        "p90": ordered[min(n - 1, (9 * n) // 10)],
        "max": ordered[-1],
    }


class LookupWaits:
    """Wait times of lookups that did not answer at once (seconds and steps), and the duration
    of engine steps that began and ended with requests in the engine."""

    def __init__(self) -> None:
        self.waits_s: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.waits_steps: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.steps_s: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.step = 0
        self._last_step: float | None = None

    def answered(self, key: bytes, final: bool, vllm_ctx: Any) -> float:
        """Record one answer for ``key`` to the request of ``vllm_ctx`` (``final``: HIT or MISS);
        return how long the request has waited for ``key`` so far (seconds; 0 if it has not)."""
        pending = vllm_ctx.get_state(_Pending)
        now = time.monotonic()
        if final:
            started = pending.pop(key, None) if pending else None
            if started is None:
                return 0.0
            self.waits_s.append(now - started[0])
            self.waits_steps.append(self.step - started[1])
            return now - started[0]
        if pending is None:
            pending = _Pending()
            vllm_ctx.set_state(pending)
        started = pending.setdefault(key, (now, self.step))
        return now - started[0]

    def step_ended(self, busy: bool) -> None:
        """One scheduler step ended; ``busy``: requests are in the engine (between vLLM's
        ``on_new_request`` and ``on_request_finished``). A step is timed when the one before it
        ended busy too (so an idle gap, where vLLM does not step, is never taken for a step)."""
        now = time.monotonic()
        self.step += 1
        if busy and self._last_step is not None:
            self.steps_s.append(now - self._last_step)
        self._last_step = now if busy else None

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            "lookup_wait_s": _quantiles(self.waits_s),
            "lookup_wait_steps": _quantiles(self.waits_steps),
            "engine_step_s": _quantiles(self.steps_s),
        }
