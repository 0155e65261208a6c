"""Measured costs of loading and of computing, kept current, and the load decision they feed.

A hit is worth loading only if loading it is faster than computing it. The estimates:

* **Loading** (seconds per offloaded block, i.e. per key: a block of every KV-cache group counts
  once per group): host -> device from the load jobs' own copy times (``TransferResult.seconds``
  over their keys), each secondary tier's promotion into the host from the tier's promotion jobs
  (``promotion_us`` over ``promotion_blocks`` of
  :meth:`~kvoffload.manager_contract.OffloadingManager.tier_stats`, the series behind
  ``kvoffload_tier_promotion_job_seconds``). A promoted block costs its promotion plus the host
  load after it. Each is a ratio of exponentially decayed sums, seconds over blocks
  (:class:`PerBlock`, shared with the router's :mod:`~kvoffload.routing.costs`), so an interval
  weighs as many blocks as it moved.
* **Computing** (seconds per token, at the current batch size): the engine's forward steps,
  fitted as ``seconds ~ base + tokens x per_token`` (:class:`StepCostModel`, the fit ``kvoffload
  serve`` exports); a token recomputed in this step adds ``per_token`` (the fit's slope) to it.
* **One step** (what an asynchronous load costs at least: its request is loaded during a step
  and computes from the next, so it needs one step more): the fit's base, the fixed cost of a
  step beyond the tokens computed in it (the rest of a step is other requests' tokens, computed
  either way). Charged only while no other request waits (:attr:`LoadCosts.step_charged`): a
  saturated engine fills the step a loading request leaves, so its load costs no throughput.

Priors until measured: :data:`PRIOR_TOKEN_S` per token, a host load of
:data:`PRIOR_LOAD_FRACTION` of computing the block, a promotion of that fraction per tier, and
no step wait (so an engine that has measured nothing loads every hit, as before).

**Probes**: a host estimate that says loading does not pay is only re-measured by a load, which
it stops. A slow first copy (a thread starting, a stall on a loaded machine) would then keep every
later hit recomputed. So after :data:`PROBE_AFTER_DECLINES` decisions in a row that left blocks of
a hit to recompute with no host load measured since, the host estimate is forgotten (back to the
prior): the next hit is loaded, and its copy measured afresh. A tier that is really slow costs
one load per :data:`PROBE_AFTER_DECLINES` declined hits. Pinned estimates are never forgotten. The
reference engine's connector counts a decision once the engine acts on it (:meth:`LoadCosts.decided`:
its request is admitted), not per lookup: a waiting request asked again every step is one
decision; other callers' decisions count when the next one is made.

**The decision** (:class:`PayingPrefix`, ``load_policy="auto"``): loading the first ``k`` blocks
of a hit takes ``max(load_k, step)`` (``load_k`` their summed load costs: the load runs beside the
step, and the request waits at least that step) where computing them takes ``k x
compute_block``; the prefix taken is the ``k`` with the largest saving, none if no ``k`` saves.
A hit of one or two blocks is thus computed in the same step whenever that is faster than a step,
and a tier slower than computing ends the prefix where its blocks begin. One addition and one
comparison per block, folded into the lookup loop that exists anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvoffload.errors import ConfigError

__all__ = [
    "LOAD_POLICIES",
    "PRIOR_LOAD_FRACTION",
    "PRIOR_TOKEN_S",
    "PROBE_AFTER_DECLINES",
    "LoadCosts",
    "PayingPrefix",
    "PerBlock",
    "StepCostModel",
    "check_load_policy",
]

#: ``auto``: load the prefix of a hit that pays; ``always``: every hit; ``never``: none (stores
#: still happen).
LOAD_POLICIES = ("auto", "always", "never")
PRIOR_TOKEN_S = 5e-4
PRIOR_LOAD_FRACTION = {"host": 0.05, "disk": 0.3, "remote": 0.5}
#: The prior of a secondary tier the table does not name.
_PRIOR_SECONDARY_FRACTION = 0.5
#: Declined decisions in a row (no host load measured since) before a probe (module docstring).
PROBE_AFTER_DECLINES = 16


def check_load_policy(value: object, setting: str = "load_policy") -> str:
    """``value`` if it is one of :data:`LOAD_POLICIES`, else :class:`ConfigError` naming
    ``setting``."""
    if value not in LOAD_POLICIES:
        raise ConfigError(
            setting, f"unknown load policy {value!r}; choose from {list(LOAD_POLICIES)}"
        )
    return str(value)


@dataclass
class PerBlock:
    """Seconds per block over the intervals seen, each interval's seconds and blocks added to
    sums that decay by ``1 - alpha`` per interval with blocks."""

    alpha: float
    seconds: float = 0.0
    blocks: float = 0.0

    def add(self, seconds: float, blocks: float) -> float:
        """Fold in one interval (``blocks`` > 0); returns the estimate."""
        keep = 1.0 - self.alpha
        self.seconds = self.seconds * keep + max(seconds, 0.0)
        self.blocks = self.blocks * keep + blocks
        return self.seconds / self.blocks

    @property
    def estimate(self) -> float | None:
        """Seconds per block, ``None`` before any block."""
        return self.seconds / self.blocks if self.blocks > 0 else None


class StepCostModel:
    """``seconds ~ base_s + per_token_s * tokens`` per engine step, by exponentially weighted
    least squares (``decay`` per step). Where the fit is not positive (one token count seen so
    far, or noise tipping the base below zero or the slope to it), the line through the origin
    that fits best: ``per_token_s = sum(tokens * seconds) / sum(tokens^2)``, dominated by the
    large (prefill) steps, never the mean step time over the mean token count (a few-token
    decode step would charge its whole fixed cost to each token: a prefill predicted 10x too
    slow)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.steps = 0
        self.seconds = 0.0
        self.tokens = 0
        self._fit: tuple[float, float] | None = None  # fit() since the last observe

    def observe(self, tokens: int, seconds: float) -> None:
        self._fit = None
        d = self.decay
        self._w = self._w * d + 1
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens

    def fit(self) -> tuple[float, float]:
        """``(base_s, per_token_s)``, both >= 0 (``(0, 0)`` before any step); computed once
        per observation (a decision reads it several times)."""
        fit = self._fit
        if fit is None:
            fit = self._fit = self._solve()
        return fit

    def _solve(self) -> tuple[float, float]:
        if self._x <= 0:
            return 0.0, 0.0
        through_origin = 0.0, max(self._xy / self._xx, 0.0)
        denom = self._w * self._xx - self._x * self._x
        if denom <= 1e-9 * self._w * self._xx:
            return through_origin
        slope = (self._w * self._xy - self._x * self._y) / denom
        base = (self._y - slope * self._x) / self._w
        if slope <= 0 or base < 0:
            return through_origin
        return base, slope


class LoadCosts:
    """The current estimates (module docstring): fed by the connector (loads, promotions) and
    the engine (steps); read once per lookup. ``pinned`` fixes the estimates (tests,
    benchmarks that want a known decision): ``{"token_s": ..., "step_s": ..., "host": ...,
    "<tier>": ...}`` (a tier's value is its promotion per block); observations are then
    ignored."""

    def __init__(
        self,
        secondary_tiers: Iterable[str] = (),
        alpha: float = 0.3,
        pinned: Mapping[str, float] | None = None,
    ) -> None:
        self.tiers = tuple(secondary_tiers)
        self.alpha = alpha
        self._host = PerBlock(alpha)
        self._promotions = {tier: PerBlock(alpha) for tier in self.tiers}
        self.compute = StepCostModel()
        #: Whether one more step costs its base: not while other requests wait for the room
        #: (they fill the step a loading request leaves); the engine updates it every step.
        self.step_charged = True
        self._promotion_totals: dict[str, tuple[float, float]] = {}
        self._pinned = dict(pinned) if pinned is not None else None
        #: the last decision counted when the next is made (``decision(counted=True)``), and
        #: the declined ones in a row since a host load was measured
        self._last: PayingPrefix | None = None
        self._declines = 0

    # ------------------------------------------------------------------ observations

    def observe_load(self, seconds: float, blocks: float) -> None:
        """A host -> device load of ``blocks`` keys took ``seconds`` (its copy time)."""
        if blocks > 0:
            self._host.add(seconds, blocks)
            self._declines = 0

    def observe_promotion(self, tier: str, seconds: float, blocks: float) -> None:
        """``tier``'s promotions of ``blocks`` keys into the host took ``seconds`` in all."""
        per_block = self._promotions.get(tier)
        if per_block is not None and blocks > 0:
            per_block.add(seconds, blocks)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """An engine step computed ``tokens`` (0: only decodes, or nothing it could count) in
        ``seconds``, scheduling included."""
        self.compute.observe(tokens, seconds)

    def fold_promotions(self, tier_stats: Mapping[str, Mapping[str, float]]) -> None:
        """Fold in each secondary tier's promotions since the last call, from its running
        totals (``promotion_us``, ``promotion_blocks``:
        :meth:`~kvoffload.manager_contract.OffloadingManager.tier_stats`)."""
        totals = self._promotion_totals
        for tier, stats in tier_stats.items():
            blocks = stats.get("promotion_blocks")
            if blocks is None:
                continue
            seconds = stats.get("promotion_us", 0) / 1e6
            last_s, last_blocks = totals.get(tier, (0.0, 0.0))
            if blocks > last_blocks:
                self.observe_promotion(tier, seconds - last_s, blocks - last_blocks)
            totals[tier] = (seconds, float(blocks))

    # ------------------------------------------------------------------ estimates

    @property
    def token_s(self) -> float:
        """Seconds to compute one more token in a step (the fit's slope; prior until measured)."""
        if self._pinned is not None:
            return self._pinned.get("token_s", PRIOR_TOKEN_S)
        slope = self.compute.fit()[1]
        return slope if slope > 0 else PRIOR_TOKEN_S

    @property
    def step_s(self) -> float:
        """What one more engine step costs: its fixed part (the fit's base; the rest of a step
        is the tokens computed in it, which are computed either way)."""
        if self._pinned is not None:
            return self._pinned.get("step_s", 0.0)
        return self.compute.fit()[0] if self.step_charged else 0.0

    def host_block_s(self, block_tokens: int) -> float:
        """Seconds to load one key host -> device (``block_tokens`` prices the prior)."""
        if self._pinned is not None and "host" in self._pinned:
            return self._pinned["host"]
        measured = self._host.estimate
        if measured is not None:
            return measured
        return PRIOR_LOAD_FRACTION["host"] * self.token_s * block_tokens

    def promotion_block_s(self, tier: str, block_tokens: int) -> float:
        """Seconds to promote one key from ``tier`` into the host (prior until measured)."""
        if self._pinned is not None and tier in self._pinned:
            return self._pinned[tier]
        per_block = self._promotions.get(tier)
        measured = None if per_block is None else per_block.estimate
        if measured is not None:
            return measured
        fraction = PRIOR_LOAD_FRACTION.get(tier, _PRIOR_SECONDARY_FRACTION)
        return fraction * self.token_s * block_tokens

    def promoted_block_s(self, block_tokens: int) -> float:
        """A block a lookup answered ``RETRY`` for (being promoted, from a tier the answer does
        not name): the slowest tier's promotion plus the host load."""
        worst = max(
            (self.promotion_block_s(t, block_tokens) for t in self.tiers),
            default=self.promotion_block_s("remote", block_tokens),
        )
        return worst + self.host_block_s(block_tokens)

    @property
    def promoted_source(self) -> str:
        """The tier a ``RETRY`` block is counted under: the one secondary tier, if only one."""
        return self.tiers[0] if len(self.tiers) == 1 else "secondary"

    def decision(
        self, block_tokens: int, keys_per_block: int = 1, counted: bool = True
    ) -> PayingPrefix:
        """A fresh :class:`PayingPrefix` for blocks of ``block_tokens`` tokens, each made of
        ``keys_per_block`` keys (one per KV-cache group); a promoted block is priced at the
        first one only. ``counted``: it counts towards a probe when the next decision is made;
        a caller that knows which decisions the engine acts on passes ``False`` and reports
        those with :meth:`decided`."""
        last, self._last = self._last, None
        if last is not None:
            self.decided(last)
        pay = PayingPrefix(
            compute_block_s=self.token_s * block_tokens,
            step_s=self.step_s,
            host_block_s=self.host_block_s(block_tokens) * keys_per_block,
            promoted_block_s=lambda: self.promoted_block_s(block_tokens) * keys_per_block,
        )
        if counted:
            self._last = pay
        return pay

    def decided(self, pay: PayingPrefix) -> None:
        """The engine acted on ``pay`` (admitted its request with that answer). One that left
        blocks of a hit to recompute counts towards a probe; once one is due, the host estimate
        is forgotten (module docstring)."""
        if pay.best >= pay.blocks:
            return
        self._declines += 1
        if self._declines >= PROBE_AFTER_DECLINES:
            self._declines = 0
            self._host = PerBlock(self.alpha)  # forgotten: the prior until the probe's copy

    def snapshot(self, block_tokens: int) -> dict[str, float]:
        """The estimates as stats (gauges): ``cost_token_s`` (computing one token),
        ``cost_step_s`` (one step) and ``cost_load_<tier>_s`` (loading one key from ``tier``
        into the device: a secondary tier's promotion plus the host load)."""
        host = self.host_block_s(block_tokens)
        out = {"cost_token_s": self.token_s, "cost_step_s": self.step_s, "cost_load_host_s": host}
        for tier in self.tiers:
            out[f"cost_load_{tier}_s"] = self.promotion_block_s(tier, block_tokens) + host
        return out

    def measured(self) -> dict[str, bool]:
        """Which estimates are measured rather than priors: ``compute``, ``host`` and each tier."""
        out = {"compute": self.compute.fit()[1] > 0, "host": self._host.estimate is not None}
        for tier, per_block in self._promotions.items():
            out[tier] = per_block.estimate is not None
        return out

    def pin(self, values: Mapping[str, float] | None) -> None:
        """Fix the estimates to ``values`` (the constructor's ``pinned``), or measure again
        (``None``)."""
        self._pinned = dict(values) if values is not None else None


class PayingPrefix:
    """The best-paying leading prefix of one hit, found block by block (module docstring).

    Feed each block of the hit in order (:meth:`host` or :meth:`promoted`); :attr:`best` is then
    the number of leading blocks worth loading and :attr:`best_promoted` how many of those were
    promoted blocks. ``promoted_block_s`` may be a function, called at the first promoted block."""

    __slots__ = (
        "best",
        "best_gain",
        "best_promoted",
        "blocks",
        "compute_block_s",
        "host_block_s",
        "load_s",
        "promoted",
        "promoted_block_s",
        "step_s",
    )

    def __init__(
        self,
        compute_block_s: float,
        step_s: float,
        host_block_s: float,
        promoted_block_s: float | Callable[[], float],
    ) -> None:
        self.compute_block_s = compute_block_s
        self.step_s = step_s
        self.host_block_s = host_block_s
        self.promoted_block_s = promoted_block_s
        self.blocks = 0
        self.promoted = 0
        self.load_s = 0.0
        self.best = 0
        self.best_promoted = 0
        self.best_gain = 0.0

    def host(self) -> None:
        """The next block loads from the host tier."""
        self._add(self.host_block_s)

    def promoted_block(self) -> None:
        """The next block is being promoted from a secondary tier."""
        self.promoted += 1
        price = self.promoted_block_s
        if callable(price):  # priced at the first promoted block
            price = self.promoted_block_s = price()
        self._add(price)

    def _add(self, load_block_s: float) -> None:
        self.blocks += 1
        self.load_s += load_block_s
        load = self.load_s if self.load_s > self.step_s else self.step_s
        gain = self.blocks * self.compute_block_s - load
        if gain > self.best_gain:
            self.best, self.best_gain, self.best_promoted = self.blocks, gain, self.promoted
