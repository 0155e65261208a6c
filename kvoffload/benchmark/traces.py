"""Seeded generators of Mooncake-format traces, and the trace suite eviction policies are judged on.

A trace is a list of requests; each request's ``hash_ids`` names its blocks in prefix order, and
equal ids mean equal *prefixes* (as in the Mooncake traces, whose ids hash the whole prefix). The
generators build requests from content symbols and turn them into ids through a trie
(:class:`BlockIds`), so an id is shared exactly when the whole prefix up to it is: a document
retrieved second in one request and first in another are different blocks, as in a real prefix
cache.

Every generator is deterministic for its arguments (``seed`` included) and returns records with
``timestamp`` (the request's index), ``input_length`` (512 tokens per block), ``output_length``
and ``hash_ids``. :data:`SUITE` names the generated workloads of the suite with their parameters;
the suite also includes the Mooncake conversation trace, a file the user points at
(``--dataset-path``).
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCK_TOKENS",
    "SUITE",
    "BlockIds",
    "agent_loops",
    "bursts",
    "dumps",
    "generate",
    "mix",
    "rag",
    "scans",
    "tenants",
    "write",
]

#: Tokens per block in the Mooncake traces.
BLOCK_TOKENS = 512

Record = dict[str, Any]


class BlockIds:
    """Block ids for prefix chains: the id of a block is fixed by the whole prefix up to it.

    ``chain(symbols)`` walks a trie from the root, one edge per content symbol (any hashable);
    a new edge gets the next free id. Two chains share an id at position ``i`` iff their first
    ``i + 1`` symbols are equal.
    """

    def __init__(self) -> None:
        self._edges: dict[tuple[int, Hashable], int] = {}
        self._next = 0

    def chain(self, symbols: Iterable[Hashable]) -> list[int]:
        edges = self._edges
        parent = -1
        out = []
        for symbol in symbols:
            edge = (parent, symbol)
            block_id = edges.get(edge)
            if block_id is None:
                block_id = edges[edge] = self._next
                self._next += 1
            out.append(block_id)
            parent = block_id
        return out


class _Zipf:
    """Draw ranks ``0..n-1`` with probability proportional to ``1 / (rank + 1) ** s``."""

    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        self._cum = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n)))
        self._rng = rng

    def draw(self) -> int:
        return bisect.bisect(self._cum, self._rng.random() * self._cum[-1])


class _Fresh:
    """Symbols never used before (a request's own content)."""

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace
        self._count = itertools.count()

    def take(self, n: int) -> list[Hashable]:
        return [(self._namespace, next(self._count)) for _ in range(n)]


def _record(index: int, ids: list[int], rng: random.Random) -> Record:
    tail = rng.randint(1, BLOCK_TOKENS)  # the last block is partial
    return {
        "timestamp": index,
        "input_length": (len(ids) - 1) * BLOCK_TOKENS + tail,
        "output_length": rng.randint(16, 512),
        "hash_ids": ids,
    }


def _check(**positive: float) -> None:
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def tenants(
    num_requests: int = 10_000,
    num_tenants: int = 400,
    zipf: float = 1.0,
    system_blocks: tuple[int, int] = (4, 48),
    user_blocks: tuple[int, int] = (1, 12),
    seed: int = 0,
    ids: BlockIds | None = None,
) -> list[Record]:
    """Many tenants, each with a long system prompt, popularity Zipf(``zipf``) over tenants; each
    request is its tenant's system prompt plus a user message of its own."""
    _check(num_requests=num_requests, num_tenants=num_tenants)
    rng = random.Random(f"tenants:{seed}")
    ids = ids or BlockIds()
    fresh = _Fresh(f"tenants:{seed}:user")
    lengths = [rng.randint(*system_blocks) for _ in range(num_tenants)]
    pick = _Zipf(num_tenants, zipf, rng)
    out = []
    for i in range(num_requests):
        t = pick.draw()
        symbols: list[Hashable] = [("tenant", seed, t, b) for b in range(lengths[t])]
        symbols += fresh.take(rng.randint(*user_blocks))
        out.append(_record(i, ids.chain(symbols), rng))
    return out


def agent_loops(
    num_requests: int = 8_000,
    active_sessions: int = 48,
    mean_steps: float = 14.0,
    system_variants: int = 4,
    system_blocks: int = 12,
    step_blocks: tuple[int, int] = (1, 4),
    seed: int = 0,
    ids: BlockIds | None = None,
) -> list[Record]:
    """Tool-using agents: each session re-sends its whole growing context every step (a shared
    agent prompt, its task, then every tool result and reply so far) plus the new step's blocks.
    ``active_sessions`` run at once, steps interleaved at random; a session ends after a
    geometric number of steps (mean ``mean_steps``) and a new one starts."""
    _check(num_requests=num_requests, active_sessions=active_sessions, mean_steps=mean_steps)
    rng = random.Random(f"agent:{seed}")
    ids = ids or BlockIds()
    fresh = _Fresh(f"agent:{seed}:step")
    end_chance = 1.0 / mean_steps

    def new_session() -> list[Hashable]:
        variant = rng.randrange(system_variants)
        return [("agent-system", seed, variant, b) for b in range(system_blocks)] + fresh.take(
            rng.randint(2, 8)
        )

    sessions = [new_session() for _ in range(active_sessions)]
    out = []
    for i in range(num_requests):
        s = rng.randrange(active_sessions)
        context = sessions[s]
        context += fresh.take(rng.randint(*step_blocks))
        out.append(_record(i, ids.chain(context), rng))
        if rng.random() < end_chance:
            sessions[s] = new_session()
    return out


def rag(
    num_requests: int = 10_000,
    num_documents: int = 4_000,
    zipf: float = 0.9,
    documents_per_request: tuple[int, int] = (2, 5),
    document_blocks: tuple[int, int] = (2, 12),
    system_variants: int = 3,
    system_blocks: int = 4,
    seed: int = 0,
    ids: BlockIds | None = None,
) -> list[Record]:
    """Retrieval-augmented requests: a shared system prompt, then documents drawn from a pool
    with Zipf(``zipf``) popularity, then the question. Only the leading document (and any run of
    documents another request retrieved in the same order) is a shared prefix."""
    _check(num_requests=num_requests, num_documents=num_documents)
    rng = random.Random(f"rag:{seed}")
    ids = ids or BlockIds()
    fresh = _Fresh(f"rag:{seed}:question")
    lengths = [rng.randint(*document_blocks) for _ in range(num_documents)]
    pick = _Zipf(num_documents, zipf, rng)
    out = []
    for i in range(num_requests):
        variant = rng.randrange(system_variants)
        symbols: list[Hashable] = [("rag-system", seed, variant, b) for b in range(system_blocks)]
        docs: list[int] = []
        for _ in range(rng.randint(*documents_per_request)):
            d = pick.draw()
            if d not in docs:
                docs.append(d)
        for d in docs:
            symbols += [("doc", seed, d, b) for b in range(lengths[d])]
        symbols += fresh.take(rng.randint(1, 2))
        out.append(_record(i, ids.chain(symbols), rng))
    return out


def scans(
    num_requests: int = 10_000,
    hot_prefixes: int = 60,
    zipf: float = 1.0,
    prefix_blocks: tuple[int, int] = (8, 32),
    scan_share: float = 0.1,
    scan_blocks: tuple[int, int] = (32, 192),
    seed: int = 0,
    ids: BlockIds | None = None,
) -> list[Record]:
    """A hot set of shared prefixes (Zipf popularity, short suffixes of their own) with one-off
    long requests mixed in (``scan_share`` of them): long documents read once and never again."""
    _check(num_requests=num_requests, hot_prefixes=hot_prefixes)
    rng = random.Random(f"scans:{seed}")
    ids = ids or BlockIds()
    fresh = _Fresh(f"scans:{seed}:own")
    lengths = [rng.randint(*prefix_blocks) for _ in range(hot_prefixes)]
    pick = _Zipf(hot_prefixes, zipf, rng)
    out = []
    for i in range(num_requests):
        if rng.random() < scan_share:
            symbols = fresh.take(rng.randint(*scan_blocks))
        else:
            p = pick.draw()
            symbols = [("hot", seed, p, b) for b in range(lengths[p])]
            symbols += fresh.take(rng.randint(1, 4))
        out.append(_record(i, ids.chain(symbols), rng))
    return out


def bursts(
    num_requests: int = 10_000,
    phase_requests: int = 800,
    prefixes_per_phase: int = 40,
    zipf: float = 1.0,
    prefix_blocks: tuple[int, int] = (8, 24),
    stable_prefixes: int = 20,
    stable_share: float = 0.3,
    previous_share: float = 0.1,
    seed: int = 0,
    ids: BlockIds | None = None,
) -> list[Record]:
    """Popularity that shifts: every ``phase_requests`` requests a burst of new prefixes becomes
    hot (Zipf within the burst); the previous burst keeps ``previous_share`` of the traffic and a
    small stable set ``stable_share``; each request adds a short suffix of its own."""
    _check(num_requests=num_requests, phase_requests=phase_requests)
    rng = random.Random(f"bursts:{seed}")
    ids = ids or BlockIds()
    fresh = _Fresh(f"bursts:{seed}:own")
    pick_burst = _Zipf(prefixes_per_phase, zipf, rng)
    pick_stable = _Zipf(stable_prefixes, zipf, rng)
    lengths: dict[tuple[str, int], int] = {}

    def prefix(kind: str, n: int) -> list[Hashable]:
        length = lengths.setdefault((kind, n), rng.randint(*prefix_blocks))
        return [("burst", seed, kind, n, b) for b in range(length)]

    out = []
    for i in range(num_requests):
        phase = i // phase_requests
        u = rng.random()
        if u < stable_share:
            symbols = prefix("stable", pick_stable.draw())
        elif u < stable_share + previous_share and phase > 0:
            symbols = prefix("burst", (phase - 1) * prefixes_per_phase + pick_burst.draw())
        else:
            symbols = prefix("burst", phase * prefixes_per_phase + pick_burst.draw())
        symbols += fresh.take(rng.randint(1, 6))
        out.append(_record(i, ids.chain(symbols), rng))
    return out


def mix(num_requests: int = 10_000, seed: int = 0) -> list[Record]:
    """The five other shapes at once, each a fifth of the requests, interleaved at random (each
    keeps its own order), over one id space."""
    _check(num_requests=num_requests)
    ids = BlockIds()
    share = max(1, num_requests // 5)
    streams = [
        tenants(share, seed=seed, ids=ids),
        agent_loops(share, active_sessions=16, seed=seed, ids=ids),
        rag(share, num_documents=1_000, seed=seed, ids=ids),
        scans(share, seed=seed, ids=ids),
        bursts(share, phase_requests=300, seed=seed, ids=ids),
    ]
    rng = random.Random(f"mix:{seed}")
    order = [s for s, stream in enumerate(streams) for _ in stream]
    rng.shuffle(order)
    positions = [0] * len(streams)
    out = []
    for i, s in enumerate(order):
        record = dict(streams[s][positions[s]], timestamp=i)
        positions[s] += 1
        out.append(record)
    return out


#: The generated workloads of the suite: name -> (generator, keyword arguments).
SUITE: dict[str, tuple[Callable[..., list[Record]], dict[str, Any]]] = {
    "tenants": (tenants, {}),
    "agent": (agent_loops, {}),
    "rag": (rag, {}),
    "scans": (scans, {}),
    "bursts": (bursts, {}),
    "mix": (mix, {}),
}


def generate(name: str, seed: int = 0, num_requests: int | None = None) -> list[Record]:
    """The suite's workload ``name`` for ``seed`` (``num_requests`` overrides its length)."""
    if name not in SUITE:
        raise KeyError(f"unknown generated trace {name!r}; choose from {sorted(SUITE)}")
    generator, kwargs = SUITE[name]
    kwargs = dict(kwargs, seed=seed)
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    return generator(**kwargs)


def dumps(records: Sequence[Record]) -> str:
    """The trace as Mooncake JSONL text (one record per line)."""
    buf = io.StringIO()
    for record in records:
        buf.write(json.dumps(record, separators=(", ", ": ")))
        buf.write("\n")
    return buf.getvalue()


def write(records: Sequence[Record], path: str | Path) -> None:
    """Write the trace to ``path`` as Mooncake JSONL."""
    Path(path).write_text(dumps(records), encoding="utf-8")
