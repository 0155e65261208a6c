"""Routing policies: which backend gets a request.

* ``round_robin``: the next healthy backend in turn.
* ``least_load``: the fewest requests in flight (from this router), ties in turn.
* ``session``: sticky by the ``x-session-id`` header or the body's ``user`` (rendezvous hashing
  over the healthy backends, so a backend's loss moves only its own sessions); without either,
  ``least_load``.
* ``kv_aware`` (default): the lowest predicted time to first token::

      queue + computed blocks x compute s/block + sum over tiers (loaded blocks x load s/block)

  with costs measured (:mod:`kvoffload.routing.costs`: computing at the fleet's median, loads
  per backend) and ``queue`` the prefill work still ahead of the request there: its requests
  without a first token, each predicted to take its prefill seconds once the ones before it are
  done, less the time already spent on them (a prefill that ends early pulls the rest forward),
  so a backend that has nearly finished its queue is not taken for one just handed it; plus,
  while its oldest such request is overdue, how long it has been overdue (a stalled backend
  looks busy for as long as it stalls, not idle once its predictions ran out). ``tier_weights``
  changes how cached blocks count, for comparison: ``measured`` (the default, above), ``blind``
  (a cached block costs nothing wherever it is, as scorers that ignore tiers assume), or
  ``dynamo`` (NVIDIA Dynamo's formula: ``max(active prefill blocks + prompt blocks - credit, 0) +
  decode blocks``, static credits device 1.0, host 0.75, disk 0.25, shared 0.5).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from kvoffload.routing.costs import BackendCosts
from kvoffload.routing.index import Match

__all__ = ["DYNAMO_CREDITS", "POLICIES", "TIER_WEIGHTS", "BackendLoad", "Policy", "Target",
           "choose", "predicted_ttft", "prefill_s"]

POLICIES = ("kv_aware", "round_robin", "least_load", "session")
TIER_WEIGHTS = ("measured", "blind", "dynamo")
#: Dynamo's static overlap credits (router-offloading.md): device, host, disk, shared pool.
DYNAMO_CREDITS = {"device": 1.0, "host": 0.75, "disk": 0.25, "remote": 0.5}
_NO_MATCH = Match()


@dataclass
class BackendLoad:
    """A backend's requests in flight from this router: all of them, those still before their
    first token (their prompt blocks, and ``busy_until``: when, on the ``time.monotonic()``
    clock, their predicted prefills are done one after another), and those decoding.
    ``pulled_s``: how far prefills that ended early have pulled ``busy_until`` forward in all
    (a request's predicted end moves with it). ``pending``: per request without a first token,
    in the order sent, its predicted end and ``pulled_s`` when it was sent."""

    in_flight: int = 0
    busy_until: float = 0.0
    pulled_s: float = 0.0
    prefill_blocks: int = 0
    decode_blocks: int = 0
    pending: dict[int, tuple[float, float]] = field(default_factory=dict)

    def start_prefill(self, request: int, prefill_s: float, blocks: int, now: float) -> None:
        """``request`` (any id unique among those pending) sent at ``now``, predicted to take
        ``prefill_s`` once the backend's earlier prefills are done."""
        self.busy_until = max(self.busy_until, now) + prefill_s
        self.pending[request] = (self.busy_until, self.pulled_s)
        self.prefill_blocks += blocks

    def end_prefill(self, request: int, blocks: int, now: float) -> None:
        """``request``'s first token came at ``now``; if early, the work queued behind it starts
        that much sooner."""
        end, pulled = self.pending.pop(request)
        early = end - (self.pulled_s - pulled) - now
        if early > 0:
            self.busy_until -= early
            self.pulled_s += early
        self.prefill_blocks -= blocks

    def queued_s(self, now: float) -> float:
        """Predicted prefill seconds still ahead of a request sent now."""
        ahead = max(self.busy_until - now, 0.0)
        if self.pending:
            end, pulled = next(iter(self.pending.values()))
            overdue = now - (end - (self.pulled_s - pulled))
            if overdue > 0:
                ahead += overdue
        return ahead


class Target(Protocol):
    """What a policy reads of a backend."""

    @property
    def url(self) -> str: ...

    load: BackendLoad
    costs: BackendCosts
    index_id: int | None


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


def prefill_s(costs: BackendCosts, m: Match, weights: str = "measured") -> float:
    """Predicted seconds of the request's own prefill: computed blocks, plus (``measured``)
    loaded blocks at each tier's cost."""
    compute = m.computed * costs.compute_block_s + (costs.fleet_step_s if m.total else 0.0)
    if weights == "measured":
        if m.host:
            compute += m.host * costs.load_block_s("host")
        if m.disk:
            compute += m.disk * costs.load_block_s("disk")
        if m.remote:
            compute += m.remote * costs.load_block_s("remote")
    return compute


def predicted_ttft(load: BackendLoad, costs: BackendCosts, m: Match, weights: str,
                   now: float) -> float:
    """Seconds until the first token on this backend for a request sent at ``now``
    (``measured`` / ``blind``), or Dynamo's cost in blocks (``dynamo``). Plain arithmetic: it
    runs per backend and request."""
    if weights == "dynamo":
        credit = (m.device * DYNAMO_CREDITS["device"] + m.host * DYNAMO_CREDITS["host"]
                  + m.disk * DYNAMO_CREDITS["disk"] + m.remote * DYNAMO_CREDITS["remote"])
        return max(load.prefill_blocks + m.total - credit, 0.0) + load.decode_blocks
    return load.queued_s(now) + prefill_s(costs, m, weights)


def choose(
    policy: Policy,
    targets: Sequence[Target],
    matches: Mapping[int, Match],
    session_key: str | None = None,
) -> int:
    """The position in ``targets`` to send the request to (``matches``: by index id; a target
    without one holds nothing of the prompt). Ties go round in turn. Allocates nothing per
    target beyond a session key's hash input."""
    n = len(targets)
    turn = next(policy._turn) % n
    if policy.name == "round_robin":
        return turn
    if policy.name == "session" and session_key is not None:
        best, top = 0, -1
        for i, t in enumerate(targets):
            weight = xxhash.xxh3_64_intdigest(f"{session_key}/{t.url}".encode())
            if weight > top:
                best, top = i, weight
        return best
    least_load = policy.name in ("least_load", "session")
    now = time.monotonic()
    best, best_score, best_busy = turn, float("inf"), 0
    for k in range(n):
        i = (turn + k) % n
        t = targets[i]
        busy = t.load.in_flight
        if least_load:
            score = float(busy)
        else:
            m = matches.get(t.index_id, _NO_MATCH) if t.index_id is not None else _NO_MATCH
            score = predicted_ttft(t.load, t.costs, m, policy.tier_weights, now)
        if score < best_score or (score == best_score and busy < best_busy):
            best, best_score, best_busy = i, score, busy
    return best
