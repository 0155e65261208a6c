"""Each backend's measured costs, learned online from its ``/metrics``.

* Computing: kvoffload's server exports its fitted step cost (``kvoffload_serve_token_compute_
  seconds`` per forward token, ``kvoffload_serve_step_base_seconds`` per step); vLLM exports
  prefill time (``vllm:request_prefill_time_seconds``) and prompt tokens, so seconds per computed
  prompt token is their ratio over each scrape interval.
* Loading from the host tier: seconds per block of its loads to the device
  (``kvoffload_offload_load_seconds_total`` over ``kvoffload_offload_loaded_blocks_total``).
* Loading from disk and remote: each tier's promotions into the host tier are timed on their
  own (``kvoffload_tier_promotion_job_seconds{tier}`` over
  ``kvoffload_tier_promotion_blocks_total{tier}``), so a tier's seconds per block is measured
  directly, plus the host load that follows.

Computing is priced at the median of what the backends measured (:func:`share_compute_cost`;
:data:`PRIOR_TOKEN_S` per token while none has): they serve one model, and on a shared host the
estimates of identical instances differ 2-20x by noise (0.03-0.62 ms per token across 4 `tiny`
instances at load ~6), so pricing each by its own sent every prompt without a cached prefix to
whichever looked fastest (311 of 600 requests to one of 4 backends, which overflowed its cache
while another got 8). A backend that is truly slower shows it in its queue instead: its
requests run overdue (:meth:`kvoffload.routing.policies.BackendLoad.queued_s`). Loads are each
backend's own (tiers differ: its disk, its distance to Redis), a fraction
(:data:`PRIOR_LOAD_FRACTION`) of computing the block until measured. Every estimate follows the
backend's current load: vLLM's compute cost is an exponentially weighted mean over intervals
(``alpha``); a load cost is the ratio of exponentially decayed sums, seconds over blocks
(:class:`PerBlock`), so an interval weighs as many blocks as it moved. A mean of per-interval
ratios weighs an interval of one slow block as much as one of hundreds; in one benchmark run a
backend's Redis estimate stood at 158 ms per block (its peers' 0.6-1.7 ms) and another's disk at
36 ms (0.04-0.08), and such an outlier keeps the router from sending that backend the loads
that would correct it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvoffload.scheduler.costs import PRIOR_LOAD_FRACTION, PRIOR_TOKEN_S, PerBlock

__all__ = ["PRIOR_LOAD_FRACTION", "PRIOR_TOKEN_S", "SECONDARY_TIERS", "BackendCosts", "PerBlock",
           "parse_metrics", "share_compute_cost"]


# Series read from a scrape, summed over labels unless keyed with a tier.
_SERIES = {
    "kvoffload_serve_token_compute_seconds": "token_s",
    "kvoffload_serve_step_base_seconds": "step_s",
    "kvoffload_offload_load_seconds_total": "host_load_s",
    "kvoffload_offload_loaded_blocks_total": "host_load_blocks",
    "kvoffload_num_requests_running": "running",
    "kvoffload_num_requests_waiting": "waiting",
    "vllm:request_prefill_time_seconds_sum": "vllm_prefill_s",
    "vllm:prompt_tokens_total": "vllm_prompt_tokens",
    "vllm:prefix_cache_hits_total": "vllm_prefix_hits",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}
# Per-tier series, keyed ``<key>_<tier>``.
_TIER_SERIES = {
    "kvoffload_tier_promotion_job_seconds_sum": "promotion_s",
    "kvoffload_tier_promotion_blocks_total": "promotion_blocks",
}
SECONDARY_TIERS = ("disk", "remote")


def parse_metrics(text: str) -> dict[str, float]:
    """The figures of a Prometheus text scrape that the cost model reads."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            key = _SERIES.get(name)
            if key is None and name in _TIER_SERIES:
                key = f"{_TIER_SERIES[name]}_{sample.labels.get('tier', '')}"
            if key is not None and math.isfinite(sample.value):
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass
class BackendCosts:
    """Seconds to compute one prompt token and to load one block from each tier."""

    block_size: int = 16
    alpha: float = 0.3
    token_s: float | None = None
    fleet_token_s: float = PRIOR_TOKEN_S
    step_s: float = 0.0
    fleet_step_s: float = 0.0
    host_load_s: float | None = None  # per block, host -> device
    promotion_s: dict[str, float | None] = field(
        default_factory=lambda: dict.fromkeys(SECONDARY_TIERS)
    )  # per block, tier -> host
    running: float = 0.0
    waiting: float = 0.0
    _last: dict[str, float] = field(default_factory=dict)
    _per_block: dict[str, PerBlock] = field(default_factory=dict)

    @property
    def compute_block_s(self) -> float:
        """Seconds to compute one block: the fleet's median measured cost (see above)."""
        return self.fleet_token_s * self.block_size

    def load_block_s(self, tier: str) -> float:
        """Seconds to load one block from ``tier`` into the device: a disk or remote block is
        promoted into the host, then loaded from there (priors until measured)."""
        if tier == "device":
            return 0.0
        if tier == "host":
            measured = self.host_load_s
        else:
            promotion = self.promotion_s.get(tier)
            measured = None if promotion is None else promotion + self.load_block_s("host")
        if measured is not None:
            return measured
        return PRIOR_LOAD_FRACTION.get(tier, 0.0) * self.compute_block_s

    def measured(self) -> dict[str, float | None]:
        """What has been measured so far (``None``: not yet)."""
        return {"compute_token_s": self.token_s, "load_host_s": self.host_load_s,
                **{f"promotion_{t}_s": v for t, v in self.promotion_s.items()}}

    def update(self, scrape: Mapping[str, float]) -> None:
        """Fold in one scrape (figures from :func:`parse_metrics`)."""
        last, self._last = self._last, dict(scrape)
        self.running = scrape.get("running", 0.0)
        self.waiting = scrape.get("waiting", 0.0)
        if scrape.get("token_s", 0.0) > 0:
            self.token_s = scrape["token_s"]
            self.step_s = scrape.get("step_s", 0.0)
        delta = {k: v - last.get(k, 0.0) for k, v in scrape.items()} if last else {}
        if not delta:
            return
        computed = (
            delta.get("vllm_prompt_tokens", 0.0) - delta.get("vllm_prefix_hits", 0.0)
        )
        if computed > 0 and delta.get("vllm_prefill_s", 0.0) > 0:
            self.token_s = _ewma(self.token_s, delta["vllm_prefill_s"] / computed, self.alpha)
        host_blocks = delta.get("host_load_blocks", 0.0)
        if host_blocks > 0:
            self.host_load_s = self._fold("host", delta.get("host_load_s", 0.0), host_blocks)
        for tier in SECONDARY_TIERS:
            blocks = delta.get(f"promotion_blocks_{tier}", 0.0)
            if blocks > 0:
                seconds = delta.get(f"promotion_s_{tier}", 0.0)
                self.promotion_s[tier] = self._fold(tier, seconds, blocks)

    def _fold(self, tier: str, seconds: float, blocks: float) -> float:
        per_block = self._per_block.setdefault(tier, PerBlock(self.alpha))
        return per_block.add(seconds, blocks)


def share_compute_cost(costs: Sequence[BackendCosts]) -> None:
    """Price computing on every backend at the median of the measured ``token_s`` and of their
    ``step_s`` (left as they are while none is measured)."""
    measured = [c for c in costs if c.token_s is not None]
    if measured:
        token_s = sorted(c.token_s for c in measured)[len(measured) // 2]  # type: ignore[type-var]
        step_s = sorted(c.step_s for c in measured)[len(measured) // 2]
        for c in costs:
            c.fleet_token_s, c.fleet_step_s = token_s, step_s  # type: ignore[assignment]
