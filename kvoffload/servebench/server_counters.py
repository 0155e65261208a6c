"""Where a server's time went during a run: a few of ``kvoffload serve``'s counters read from
its ``/metrics`` before and after (summed over the servers behind a router).

``step_s`` / ``step_tokens``: seconds and forward tokens of the engine steps that computed
tokens (``kvoffload_serve_step_seconds``, ``..._tokens``); ``steps``: every engine step;
``store_s`` / ``stored_blocks`` and ``load_s`` / ``loaded_blocks``: the offloading connector's
transfers between device and host (seconds summed over jobs, which overlap the steps);
``tier_stored_blocks_<tier>``: blocks written into each tier (the disk's write-through
included). A server without these series (vLLM, another server) gives ``{}``.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["counter_deltas", "scrape_counters"]

_SERIES = {
    "kvoffload_serve_step_seconds_total": "step_s",
    "kvoffload_serve_step_tokens_total": "step_tokens",
    "kvoffload_engine_steps_total": "steps",
    "kvoffload_offload_store_seconds_total": "store_s",
    "kvoffload_offload_stored_blocks_total": "stored_blocks",
    "kvoffload_offload_load_seconds_total": "load_s",
    "kvoffload_offload_loaded_blocks_total": "loaded_blocks",
}
_TIER_STORED = "kvoffload_tier_stored_blocks_total"


def counters_of(metrics_text: str) -> dict[str, float]:
    """The counters of one ``/metrics`` text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            key = _SERIES.get(s.name)
            if key is None and s.name == _TIER_STORED:
                key = f"tier_stored_blocks_{s.labels.get('tier', '?')}"
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value
    return out


def scrape_counters(urls: Sequence[str]) -> dict[str, float]:
    """The counters of the servers at ``urls``, summed (a server that does not answer adds
    nothing)."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
                text = resp.read().decode(errors="replace")
        except OSError:
            continue
        for key, value in counters_of(text).items():
            out[key] = out.get(key, 0.0) + value
    return out


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What the run added to each counter."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
