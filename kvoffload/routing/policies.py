"""Routing policies: which backend gets a request.

* ``round_robin``: the next healthy backend in turn.
* ``least_load``: the fewest requests in flight (from this router), ties in turn.
* ``session``: sticky by the ``x-session-id`` header or the body's ``user`` (rendezvous hashing
  over the healthy backends, so a backend's loss moves only its own sessions); without either,
  ``least_load``.
* ``kv_aware`` (default): the lowest predicted time to first token::

      queue + computed blocks x compute s/block + sum over tiers (loaded blocks x load s/block)

  with each backend's costs measured (:mod:`kvoffload.routing.costs`) and ``queue`` the
  predicted prefill seconds of its requests that have no first token yet. ``tier_weights``
  changes how cached blocks count, for comparison: ``measured`` (the default, above), ``blind``
  (a cached block costs nothing wherever it is, as scorers that ignore tiers assume), or
  ``dynamo`` (NVIDIA Dynamo's formula: ``max(active prefill blocks + prompt blocks - credit, 0) +
  decode blocks``, static credits device 1.0, host 0.75, disk 0.25, shared 0.5).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvoffload.routing.costs import BackendCosts
from kvoffload.routing.index import Match

__all__ = ["DYNAMO_CREDITS", "POLICIES", "TIER_WEIGHTS", "BackendLoad", "Policy", "choose"]

POLICIES = ("kv_aware", "round_robin", "least_load", "session")
TIER_WEIGHTS = ("measured", "blind", "dynamo")
#: Dynamo's static overlap credits (router-offloading.md): device, host, disk, shared pool.
DYNAMO_CREDITS = {"device": 1.0, "host": 0.75, "disk": 0.25, "remote": 0.5}


@dataclass
class BackendLoad:
    """A backend's requests in flight from this router: all of them, those still before their
    first token (with their predicted prefill seconds and prompt blocks), and those decoding."""

    in_flight: int = 0
    prefilling_s: float = 0.0
    prefill_blocks: int = 0
    decode_blocks: int = 0


@dataclass
class Candidate:
    name: str
    load: BackendLoad
    costs: BackendCosts
    match: Match | None = None


@dataclass
class Policy:
    name: str = "kv_aware"
    tier_weights: str = "measured"
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.name!r}")
        if self.tier_weights not in TIER_WEIGHTS:
            raise ValueError(f"tier_weights must be one of {TIER_WEIGHTS}, got {self.tier_weights!r}")

    @property
    def needs_match(self) -> bool:
        return self.name == "kv_aware"


def predicted_ttft(c: Candidate, weights: str) -> float:
    """Seconds until the first token on this candidate (``measured`` / ``blind``), or Dynamo's
    cost in blocks (``dynamo``)."""
    m = c.match or Match()
    if weights == "dynamo":
        credit = sum(DYNAMO_CREDITS[t] * getattr(m, t) for t in DYNAMO_CREDITS)
        return max(c.load.prefill_blocks + m.total - credit, 0.0) + c.load.decode_blocks
    costs = c.costs
    compute = m.computed * costs.compute_block_s + (costs.step_s if m.total else 0.0)
    if weights == "measured":
        compute += sum(getattr(m, t) * costs.load_block_s(t) for t in ("host", "disk", "remote"))
    return c.load.prefilling_s + compute


def choose(
    policy: Policy, candidates: Sequence[Candidate], session_key: str | None = None
) -> tuple[int, float]:
    """The position in ``candidates`` to send the request to, and its score (lower wins)."""
    n = len(candidates)
    turn = next(policy._turn)
    order = [(turn + k) % n for k in range(n)]  # ties go round in turn
    if policy.name == "round_robin":
        return order[0], 0.0
    if policy.name == "session" and session_key is not None:
        weights = [
            xxhash.xxh3_64_intdigest(f"{session_key}/{c.name}".encode()) for c in candidates
        ]
        best = max(range(n), key=weights.__getitem__)
        return best, 0.0
    if policy.name in ("least_load", "session"):
        best = min(order, key=lambda i: candidates[i].load.in_flight)
        return best, float(candidates[best].load.in_flight)
    scores = [predicted_ttft(c, policy.tier_weights) for c in candidates]
    best = min(order, key=lambda i: (scores[i], candidates[i].load.in_flight))
    return best, scores[best]
