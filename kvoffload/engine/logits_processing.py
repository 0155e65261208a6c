"""What happens to a batch's logits between the model and the pick, as vLLM's sampler does it:
``min_tokens`` (EOS and stop tokens masked), ``logit_bias`` (added), then the repetition,
frequency and presence penalties. Each is one batched tensor operation over the rows that ask
for it (rows that ask for nothing are untouched, so greedy output without them is unchanged).

What a row needs across steps lives in its request's :class:`LogitsState`: the bias as tensors
(made once) and the output's token counts and seen-token mask, updated with the new tokens only,
so a step costs O(new tokens + rows x vocabulary), never O(output length).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.engine.sampling import SamplingParams

__all__ = ["LogitsState", "apply_penalties", "process_logits"]


class LogitsState:
    """One request's logits-processing state, made on its first processed step and kept on the
    request. Invariant after :meth:`update` (each ``vocab`` wide; ids outside the vocabulary are
    left out): ``counts[t]`` is how often ``t`` is in the output so far, ``seen[t]`` whether ``t``
    is in the prompt or the output, and ``subtract[t]`` is ``frequency_penalty * counts[t] +
    presence_penalty * (counts[t] > 0)``."""

    __slots__ = ("bias_ids", "bias_values", "consumed", "counts", "device", "frequency",
                 "presence", "seen", "subtract", "vocab")

    def __init__(self, params: SamplingParams, prompt: Sequence[int] | torch.Tensor,
                 vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
        self.bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
        self.bias_values = torch.tensor([b for _, b in pairs], dtype=torch.float64, device=device)
        self.frequency, self.presence = params.frequency_penalty, params.presence_penalty
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.subtract: torch.Tensor | None = None
        self.consumed = 0  # output tokens counted so far
        if params.penalised:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.subtract = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[self._ids(prompt)] = True

    def fits(self, vocab: int, device: torch.device) -> bool:
        """Whether this state was made for logits of ``vocab`` columns on ``device``."""
        return self.vocab == vocab and self.device == device

    def update(self, output: Sequence[int]) -> None:
        """Count the tokens of ``output`` (the whole output so far) added since the last call:
        O(new tokens). ``output`` only grows (a preempted request keeps its tokens); a shorter
        one is an error of the caller's."""
        counts, seen, subtract = self.counts, self.seen, self.subtract
        if counts is None or seen is None or subtract is None or len(output) == self.consumed:
            return
        new = self._ids(output[self.consumed :])
        counts.index_add_(0, new, torch.ones(new.shape, dtype=counts.dtype, device=self.device))
        seen[new] = True
        subtract[new] = self.frequency * counts[new] + self.presence
        self.consumed = len(output)

    def _ids(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        return ids[(ids >= 0) & (ids < self.vocab)].to(self.device)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int] | torch.Tensor],
    outputs: Sequence[Sequence[int]],
    eos_token_id: int | None,
    states: Sequence[LogitsState | None] | None = None,
) -> torch.Tensor:
    """``logits`` ``(N, vocab)`` as float32 with row ``i`` adjusted by ``params[i]`` given its
    prompt ``prompts[i]`` and the tokens generated so far ``outputs[i]``: while fewer than
    ``min_tokens`` are out, EOS (``eos_token_id``, even with ``ignore_eos``, as vLLM) and the
    stop tokens get ``-inf``; the ``logit_bias`` is added; then the penalties
    (:func:`apply_penalties`). A new tensor; ``logits`` is not changed.

    ``states[i]``, when given, is row ``i``'s :class:`LogitsState`, kept by its request across
    steps and updated here with the new output tokens (then ``prompts[i]`` is not read); without
    one (``None``, or no ``states``) it is made from scratch for this call."""
    out = logits.float().clone()
    vocab = out.shape[1]
    device = out.device
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    bias_rows: list[torch.Tensor] = []
    bias_ids: list[torch.Tensor] = []
    bias_values: list[torch.Tensor] = []
    penalised: list[int] = []
    tracked: list[LogitsState] = []
    for i, p in enumerate(params):
        if len(outputs[i]) < p.min_tokens:
            stops = set(p.stop_token_ids)
            if eos_token_id is not None:
                stops.add(eos_token_id)
            ids = [t for t in stops if t < vocab]
            mask_rows += [i] * len(ids)
            mask_ids += ids
        if not (p.logit_bias or p.penalised):
            continue
        state = states[i] if states is not None else None
        if state is None or not state.fits(vocab, device):
            state = LogitsState(p, prompts[i], vocab, device)
        if len(state.bias_ids):
            bias_rows.append(torch.full(state.bias_ids.shape, i, dtype=torch.long, device=device))
            bias_ids.append(state.bias_ids)
            bias_values.append(state.bias_values)
        if p.penalised:
            state.update(outputs[i])
            penalised.append(i)
            tracked.append(state)
    if mask_rows:
        out[_index(mask_rows, device), _index(mask_ids, device)] = float("-inf")
    if bias_rows:
        out.index_put_((torch.cat(bias_rows), torch.cat(bias_ids)),
                       torch.cat(bias_values).to(out.dtype), accumulate=True)
    if penalised:
        repetition = [params[i].repetition_penalty for i in penalised]
        every_row = len(penalised) == len(params)
        rows = None if every_row else _index(penalised, device)
        penalties = apply_penalties(
            out if rows is None else out[rows],
            torch.stack([s.seen for s in tracked if s.seen is not None]),
            torch.stack([s.subtract for s in tracked if s.subtract is not None]),
            None if all(r == 1 for r in repetition) else torch.tensor(repetition, device=device),
        )
        if rows is None:
            out = penalties
        else:
            out[rows] = penalties
    return out


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    subtract: torch.Tensor,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's penalties on ``logits`` ``(R, vocab)`` (float32): ``seen`` ``(R, vocab)`` marks
    the tokens in each row's prompt or output, ``repetition`` holds one penalty per row
    (``None``: all 1). For each seen token, a positive logit is divided by the repetition penalty
    and a negative one multiplied by it; then ``subtract`` ``(R, vocab)`` is subtracted: the
    frequency and presence penalties, ``frequency * count + presence * (count > 0)`` over the
    output only (OpenAI's definition; :class:`LogitsState` keeps it). A new tensor."""
    out = logits
    if repetition is not None:
        penalty = repetition.to(logits.dtype).unsqueeze(1)
        out = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty),
                          logits)
    return out - subtract.to(logits.dtype)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
