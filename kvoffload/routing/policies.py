"""Routing policies: which backend gets a request.

Each policy is an object chosen once, by name, at construction (:func:`create_policy`); per
request it ranks the healthy backends best first (:meth:`Policy.order`): the first gets the
request, the next ones its retries, in that order.

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
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import xxhash

from kvoffload.errors import ConfigError
from kvoffload.routing.costs import BackendCosts
from kvoffload.routing.prefix_index import Match

__all__ = ["DYNAMO_CREDITS", "POLICIES", "TIER_WEIGHTS", "BackendLoad", "KVAware", "LeastLoad",
           "Policy", "RoundRobin", "Session", "Target", "create_policy", "prefill_s", "score_of"]

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


#: A backend's score for a request (lower is better): its load, its costs, what it holds of
#: the prompt, and the time now.
Score = Callable[[BackendLoad, BackendCosts, Match, float], float]


def prefill_s(costs: BackendCosts, m: Match) -> float:
    """Predicted seconds of the request's own prefill: computed blocks, plus loaded blocks at
    each tier's measured cost."""
    seconds = m.computed * costs.compute_block_s + (costs.fleet_step_s if m.total else 0.0)
    if m.host:
        seconds += m.host * costs.load_block_s("host")
    if m.disk:
        seconds += m.disk * costs.load_block_s("disk")
    if m.remote:
        seconds += m.remote * costs.load_block_s("remote")
    return seconds


def _ttft_measured(load: BackendLoad, costs: BackendCosts, m: Match, now: float) -> float:
    """Seconds until the first token for a request sent at ``now``: its queue, then its
    prefill (cached blocks loaded at their tier's cost)."""
    return load.queued_s(now) + prefill_s(costs, m)


def _ttft_blind(load: BackendLoad, costs: BackendCosts, m: Match, now: float) -> float:
    """As :func:`_ttft_measured`, a cached block free wherever it is."""
    return (load.queued_s(now) + m.computed * costs.compute_block_s
            + (costs.fleet_step_s if m.total else 0.0))


def _cost_dynamo(load: BackendLoad, costs: BackendCosts, m: Match, now: float) -> float:
    """Dynamo's cost in blocks: prefill blocks less the tiers' static credits, plus decode."""
    credit = (m.device * DYNAMO_CREDITS["device"] + m.host * DYNAMO_CREDITS["host"]
              + m.disk * DYNAMO_CREDITS["disk"] + m.remote * DYNAMO_CREDITS["remote"])
    return max(load.prefill_blocks + m.total - credit, 0.0) + load.decode_blocks


_SCORES: dict[str, Score] = {"measured": _ttft_measured, "blind": _ttft_blind,
                             "dynamo": _cost_dynamo}


def score_of(tier_weights: str) -> Score:
    """The ``kv_aware`` score of a tier weighting (see the module docstring)."""
    score = _SCORES.get(tier_weights)
    if score is None:
        raise ConfigError("tier_weights",
                          f"must be one of {TIER_WEIGHTS}, got {tier_weights!r}")
    return score


class Policy(ABC):
    """Ranks backends for a request. ``tier_weights`` only changes ``kv_aware``; it is kept on
    every policy for the router's stats."""

    name: ClassVar[str]
    #: whether :meth:`order` reads ``matches`` (the router skips the index walk otherwise)
    needs_match: ClassVar[bool] = False

    def __init__(self, tier_weights: str = "measured") -> None:
        score_of(tier_weights)  # checked here, whatever the policy
        self.tier_weights = tier_weights
        self._turn = itertools.count()

    def order(
        self,
        targets: Sequence[Target],
        matches: Mapping[int, Match],
        session_key: str | None = None,
    ) -> list[int]:
        """Positions in ``targets``, best first (``matches``: by index id; a target without
        one holds nothing of the prompt). Equal scores go round in turn, so ties spread.
        Sorts ``len(targets)`` small tuples: nothing per block."""
        n = len(targets)
        if n == 0:
            return []
        turn = next(self._turn) % n
        return self._order(targets, matches, session_key, turn, n)

    @abstractmethod
    def _order(self, targets: Sequence[Target], matches: Mapping[int, Match],
               session_key: str | None, turn: int, n: int) -> list[int]: ...


class RoundRobin(Policy):
    """In turn, from the next one."""

    name = "round_robin"

    def _order(self, targets: Sequence[Target], matches: Mapping[int, Match],
               session_key: str | None, turn: int, n: int) -> list[int]:
        return [(turn + k) % n for k in range(n)]


class LeastLoad(Policy):
    """The fewest requests in flight first; ties in turn."""

    name = "least_load"

    def _order(self, targets: Sequence[Target], matches: Mapping[int, Match],
               session_key: str | None, turn: int, n: int) -> list[int]:
        ranked = sorted((t.load.in_flight, (i - turn) % n, i) for i, t in enumerate(targets))
        return [r[2] for r in ranked]


class Session(LeastLoad):
    """Rendezvous hashing of the session key over the backends (highest weight first, so a
    retry goes where the session would move if its backend were lost); ``least_load``
    without a key."""

    name = "session"

    def _order(self, targets: Sequence[Target], matches: Mapping[int, Match],
               session_key: str | None, turn: int, n: int) -> list[int]:
        if session_key is None:
            return super()._order(targets, matches, session_key, turn, n)
        weights = [xxhash.xxh3_64_intdigest(f"{session_key}/{t.url}".encode()) for t in targets]
        return sorted(range(n), key=lambda i: -weights[i])


class KVAware(Policy):
    """The lowest score of its tier weighting first (:func:`score_of`); ties: fewer requests
    in flight, then in turn."""

    name = "kv_aware"
    needs_match = True

    def __init__(self, tier_weights: str = "measured") -> None:
        super().__init__(tier_weights)
        self.score = score_of(tier_weights)

    def _order(self, targets: Sequence[Target], matches: Mapping[int, Match],
               session_key: str | None, turn: int, n: int) -> list[int]:
        now = time.monotonic()
        score = self.score
        ranked = []
        for i, t in enumerate(targets):
            iid = t.index_id
            m = matches.get(iid, _NO_MATCH) if iid is not None else _NO_MATCH
            ranked.append((score(t.load, t.costs, m, now), t.load.in_flight, (i - turn) % n, i))
        ranked.sort()
        return [r[3] for r in ranked]


_POLICY_TYPES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (KVAware, RoundRobin, LeastLoad, Session)
}


def create_policy(name: str = "kv_aware", tier_weights: str = "measured") -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    cls = _POLICY_TYPES.get(name)
    if cls is None:
        raise ConfigError("policy", f"must be one of {POLICIES}, got {name!r}")
    return cls(tier_weights)
