"""``load_policy="auto"`` inside vLLM: answer ``MISS`` past the prefix of a hit that pays.

vLLM's scheduler asks :meth:`KVOffloadManager.lookup` key by key, in prefix order, and loads the
leading run it is answered ``HIT`` (``get_num_new_matched_tokens``); a ``MISS`` ends the run.
Whether the run pays depends on how long it is (one more step costs a fixed amount: a run of one
or two blocks is cheaper to compute), which the first key's answer cannot know. So the chooser
**looks ahead** on the request's own keys: vLLM records every key's end-token position on the
request context as the request grows (``ReqContext._offload_key_positions``, insertion-ordered),
from which it keeps, per request, each key's successor in its group (only the entries added since
the last pass are read: ``reversed`` over the dict, O(1) per new key). At the first key of a pass
it asks the manager for the keys ahead until the prefix pays or the run ends
(:class:`~kvoffload.scheduler.costs.PayingPrefix`), and keeps those answers: vLLM's following
lookups of the same keys are answered from them, so every key is asked of the manager once. Past
the look-ahead it decides incrementally: a block that does not raise the saving (a promotion
slower than computing) ends the prefix. A pass is the run of one request's lookups in one step
that follow its key chain; vLLM's next ask (a new step, another group) starts a new one.

``recomputed_by_choice`` counts what was acted on, once: vLLM re-asks a waiting request every
step until it is scheduled (no room, no token budget), and each pass declines the same hit again.
A pass's decline is held on the request by the pass's first key (one per KV cache group), replaced
by the next pass from that key, and counted when the request finishes
(:meth:`LoadChooser.request_finished`), which is also when the cost probe learns of it
(:meth:`~kvoffload.scheduler.costs.LoadCosts.decided`, as in the reference engine).

Where vLLM recorded no positions (an older vLLM), the chain is unknown: every hit is loaded, as
``always`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import islice

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.scheduler.costs import LoadCosts, PayingPrefix

__all__ = ["MAX_LOOKAHEAD", "LoadChooser"]

#: The most keys looked at ahead of vLLM's first ask in a pass (a prefix that has not paid by
#: then is not loaded).
MAX_LOOKAHEAD = 256

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
_HIT_PENDING = LookupResult.HIT_PENDING


class _RequestChoice:
    """One request's key chain and its current lookup pass."""

    __slots__ = (
        "answers",
        "expect",
        "index",
        "last_of_group",
        "limit",
        "next_key",
        "pay",
        "pending",
        "seen",
        "start",
        "step",
        "stopped",
    )

    def __init__(self) -> None:
        self.next_key: dict[OffloadKey, OffloadKey] = {}
        self.last_of_group: dict[bytes, tuple[OffloadKey, int]] = {}
        self.seen = 0
        self.step = -1
        self.expect: OffloadKey | None = None
        self.answers: dict[OffloadKey, LookupResult] = {}
        self.index = 0
        self.limit: int | None = None
        self.pay: PayingPrefix | None = None
        self.stopped = False
        self.start: OffloadKey | None = None  # the current pass's first key
        #: by a pass's first key, that pass's decision if it declined blocks, not yet counted
        self.pending: dict[OffloadKey, PayingPrefix] = {}

    def extend(self, positions: Mapping[OffloadKey, int]) -> None:
        """Link the keys vLLM recorded since the last call to their group's previous key."""
        new = len(positions) - self.seen
        if new <= 0:
            return
        fresh = list(islice(reversed(positions.items()), new))  # type: ignore[call-overload]
        fresh.reverse()
        last_of_group, next_key = self.last_of_group, self.next_key
        for key, position in fresh:
            group = key[-4:]
            last = last_of_group.get(group)
            if last is None or position > last[1]:
                if last is not None:
                    next_key[last[0]] = key
                last_of_group[group] = (key, position)
        self.seen = len(positions)


class LoadChooser:
    """Answers vLLM's lookups under ``auto`` (module docstring). ``ask``: the manager's own
    lookup of one key; ``block_tokens``: tokens of one key; ``recomputed_by_choice``: tokens of
    hits answered ``MISS`` because loading them would have been slower, by tier."""

    def __init__(self, costs: LoadCosts, block_tokens: int) -> None:
        self.costs = costs
        self.block_tokens = block_tokens
        self.recomputed_by_choice: dict[str, int] = {}

    def lookup(
        self, key: OffloadKey, ctx: ReqContext, step: int, ask: Callable[[OffloadKey], LookupResult]
    ) -> LookupResult:
        """The answer for ``key`` of the request of ``ctx`` (ours, sharing vLLM's key
        positions), in scheduler step ``step``; ``ask`` is the manager's own lookup."""
        positions = ctx.offload_key_positions
        if not positions:
            return ask(key)
        state = ctx.get_state(_RequestChoice)
        if state is None:
            state = _RequestChoice()
            ctx.set_state(state)
        if state.step != step or key != state.expect:
            self._begin_pass(key, positions, state, step, ask)
        state.expect = state.next_key.get(key)
        if state.stopped:
            return _MISS
        i = state.index
        state.index += 1
        if state.limit is not None and i >= state.limit:
            self._stop(state)
            return _MISS
        answer = state.answers.pop(key, None)
        if answer is not None:
            return answer
        answer = ask(key)
        pay = state.pay
        if pay is not None and answer in (_HIT, _RETRY, _HIT_PENDING):
            self._feed(pay, answer)
            if pay.best < pay.blocks:  # this block lowered the saving: the prefix ends here
                self._decline(state, pay)
                state.stopped = True
                return _MISS
        return answer

    def _begin_pass(
        self,
        key: OffloadKey,
        positions: Mapping[OffloadKey, int],
        state: _RequestChoice,
        step: int,
        ask: Callable[[OffloadKey], LookupResult],
    ) -> None:
        """Start a pass at ``key``: look ahead until the prefix pays, the run ends or
        :data:`MAX_LOOKAHEAD` keys."""
        state.extend(positions)
        state.pending.pop(key, None)  # asked again from this key: this pass decides anew
        state.start = key
        state.step, state.index, state.stopped, state.limit = step, 0, False, None
        state.answers.clear()
        pay = self.costs.decision(self.block_tokens, counted=False)
        state.pay = pay
        answers, next_key = state.answers, state.next_key
        probe: OffloadKey | None = key
        while probe is not None and pay.best == 0 and pay.blocks < MAX_LOOKAHEAD:
            answer = ask(probe)
            answers[probe] = answer
            if answer is not _HIT and answer is not _RETRY and answer is not _HIT_PENDING:
                break
            self._feed(pay, answer)
            probe = next_key.get(probe)
        if pay.best == 0:
            self._decline(state, pay)
            state.stopped = True
        elif pay.best < pay.blocks:
            state.limit = pay.best

    def request_finished(self, ctx: ReqContext) -> None:
        """Count the request's pending declines (each key's last pass was the one acted on)."""
        state = ctx.get_state(_RequestChoice)
        if state is not None:
            for pay in state.pending.values():
                self._count(pay.promoted - pay.best_promoted, pay.blocks - pay.best)
                self.costs.decided(pay)
            state.pending.clear()

    def _stop(self, state: _RequestChoice) -> None:
        if state.pay is not None:
            self._decline(state, state.pay)
        state.stopped = True

    @staticmethod
    def _decline(state: _RequestChoice, pay: PayingPrefix) -> None:
        """This pass's decision ``pay`` leaves the hit's blocks past ``pay.best`` to recompute:
        pending until the request finishes."""
        if pay.blocks > pay.best and state.start is not None:
            state.pending[state.start] = pay

    @staticmethod
    def _feed(pay: PayingPrefix, answer: LookupResult) -> None:
        if answer is _RETRY:
            pay.promoted_block()
        else:
            pay.host()

    def _count(self, promoted: int, blocks: int) -> None:
        """``blocks`` keys of hits (``promoted`` of them being promoted) left to recompute."""
        by_tier = self.recomputed_by_choice
        if promoted:
            source = self.costs.promoted_source
            by_tier[source] = by_tier.get(source, 0) + promoted * self.block_tokens
        if blocks > promoted:
            by_tier["host"] = by_tier.get("host", 0) + (blocks - promoted) * self.block_tokens
