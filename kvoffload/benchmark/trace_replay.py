"""One trace replayed through every policy (and the references) at every capacity, scored
(:mod:`kvoffload.benchmark.trace_score`): the figures of ``kvoffload bench trace``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kvoffload.benchmark.hit_rate import belady_hits, block_keys, infinite_hits, replay_hits
from kvoffload.benchmark.trace_score import ScoredTrace

__all__ = ["METRICS", "replay_trace"]

#: ``--weight`` -> the figure the tables and the plot show.
METRICS: dict[str, str] = {"tokens": "token_hit_rate", "blocks": "block_hit_ratio"}

Weight = Literal["tokens", "blocks"]


def replay_trace(
    trace: ScoredTrace,
    capacities: Sequence[int],
    policies: Sequence[str],
    references: bool,
    weight: Weight = "tokens",
    progress: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Every policy (and, with ``references``, the infinite cache and Belady) at every capacity
    the trace fills (:meth:`ScoredTrace.filled`; the others are not replayed and score ``None``).

    The result (JSON-ready): the trace's counts, ``capacities``, ``filled``, and per row
    (``policies[name]``, ``belady``, ``infinite``) the figure ``weight`` selects;
    ``token_hit_rate`` and ``block_hit_ratio`` hold both figures of every row by name.
    """
    requests = trace.requests
    keys = block_keys(requests)
    filled = [trace.filled(c) for c in capacities]
    figures: dict[str, dict[str, Any]] = {metric: {} for metric in METRICS.values()}

    def score(name: str, hits: Sequence[int] | None) -> float | None:
        if hits is None:
            for rows in figures.values():
                rows.setdefault(name, []).append(None)
            return None
        rates = {
            "token_hit_rate": trace.token_hit_rate(hits),
            "block_hit_ratio": trace.block_hit_ratio(hits),
        }
        for metric, value in rates.items():
            figures[metric].setdefault(name, []).append(value)
        return rates[METRICS[weight]]

    result: dict[str, Any] = {
        "requests": len(requests),
        "blocks": sum(len(ids) for ids in requests),
        "distinct_blocks": len(keys),
        "warmup_requests": trace.warmup,
        "warmup_distinct_blocks": trace.warmup_blocks,
        "scored_blocks": trace.scored_blocks(),
        "scored_input_tokens": trace.input_tokens(),
        "capacities": list(capacities),
        "filled": filled,
        "policies": {},
        "replay_s": {},
    }
    if references:
        infinite = infinite_hits(requests)
        figures["token_hit_rate"]["infinite"] = trace.token_hit_rate(infinite)
        figures["block_hit_ratio"]["infinite"] = trace.block_hit_ratio(infinite)
        result["infinite"] = figures[METRICS[weight]]["infinite"]
        result["belady"] = [
            score("belady", belady_hits(requests, c) if ok else None)
            for c, ok in zip(capacities, filled, strict=True)
        ]
    for name in policies:
        start = time.perf_counter()
        result["policies"][name] = [
            score(name, replay_hits(requests, keys, name, c, progress) if ok else None)
            for c, ok in zip(capacities, filled, strict=True)
        ]
        result["replay_s"][name] = time.perf_counter() - start
    result.update(figures)
    return result
