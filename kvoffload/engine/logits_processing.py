"""What happens to a batch's logits between the model and the pick, as vLLM's sampler does it:
``min_tokens`` (EOS and stop tokens masked), ``logit_bias`` (added), then the repetition,
frequency and presence penalties. Each is one batched tensor operation over the rows that ask
for it (rows that ask for nothing are untouched, so greedy output without them is unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.engine.sampling import SamplingParams

__all__ = ["apply_penalties", "process_logits"]


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int] | torch.Tensor],
    outputs: Sequence[Sequence[int]],
    eos_token_id: int | None,
) -> torch.Tensor:
    """``logits`` ``(N, vocab)`` as float32 with row ``i`` adjusted by ``params[i]`` given its
    prompt ``prompts[i]`` and the tokens generated so far ``outputs[i]``: while fewer than
    ``min_tokens`` are out (a prompt may be a 1-D id tensor: no conversion per step), EOS (``eos_token_id``, even with ``ignore_eos``, as vLLM) and the
    stop tokens get ``-inf``; the ``logit_bias`` is added; then the penalties
    (:func:`apply_penalties`). A new tensor; ``logits`` is not changed."""
    out = logits.float().clone()
    vocab = out.shape[1]
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    biases: list[torch.Tensor] = []  # per biased row: (k, 3) of (row, token id, bias)
    penalised: list[int] = []
    for i, p in enumerate(params):
        if len(outputs[i]) < p.min_tokens:
            stops = set(p.stop_token_ids)
            if eos_token_id is not None:
                stops.add(eos_token_id)
            ids = [t for t in stops if t < vocab]
            mask_rows += [i] * len(ids)
            mask_ids += ids
        if p.logit_bias:
            pairs = torch.tensor(p.logit_bias, dtype=torch.float64)
            biases.append(torch.cat([torch.full((len(pairs), 1), float(i),
                                                dtype=torch.float64), pairs], dim=1))
        if p.penalised:
            penalised.append(i)
    device = out.device
    if mask_rows:
        out[_index(mask_rows, device), _index(mask_ids, device)] = float("-inf")
    if biases:
        table = torch.cat(biases)
        table = table[table[:, 1] < vocab].to(device)
        out.index_put_((table[:, 0].long(), table[:, 1].long()), table[:, 2].to(out.dtype),
                       accumulate=True)
    if penalised:
        rows = _index(penalised, device)
        out[rows] = apply_penalties(
            out[rows],
            [prompts[i] for i in penalised],
            [outputs[i] for i in penalised],
            torch.tensor([params[i].repetition_penalty for i in penalised], device=device),
            torch.tensor([params[i].frequency_penalty for i in penalised], device=device),
            torch.tensor([params[i].presence_penalty for i in penalised], device=device),
        )
    return out


def apply_penalties(
    logits: torch.Tensor,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    outputs: Sequence[Sequence[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on ``logits`` ``(R, vocab)`` (float32), one value per row in each of
    ``repetition``, ``frequency`` and ``presence``: for each token seen in the row's prompt or
    output, a positive logit is divided by the repetition penalty and a negative one
    multiplied by it; then ``frequency * count_in_output`` and ``presence * (count > 0)`` are
    subtracted (OpenAI's definition: the output only). A new tensor."""
    num_rows, vocab = logits.shape
    dtype, device = logits.dtype, logits.device
    # One spare column: the padding id ``vocab`` reads and writes there, then it is dropped.
    out = torch.cat([logits, torch.zeros((num_rows, 1), dtype=dtype, device=device)], dim=1)
    output_ids = _padded(outputs, num_rows, vocab, device)
    seen = torch.cat([_padded(prompts, num_rows, vocab, device), output_ids], dim=1)
    # Repetition: only the seen ids, gathered and written back (a repeated id writes the same
    # value twice), so the work scales with the tokens seen, not the vocabulary.
    values = out.gather(1, seen)
    penalty = repetition.to(dtype).unsqueeze(1)
    out.scatter_(1, seen, torch.where(values > 0, values / penalty, values * penalty))
    counts = torch.zeros((num_rows, vocab + 1), dtype=dtype, device=device)
    counts.scatter_add_(1, output_ids, torch.ones(output_ids.shape, dtype=dtype, device=device))
    out.sub_(frequency.to(dtype).unsqueeze(1) * counts)
    out.sub_(presence.to(dtype).unsqueeze(1) * (counts > 0))
    return out[:, :vocab]


def _padded(
    rows: Sequence[Sequence[int] | torch.Tensor], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """``rows`` as one ``(num_rows, longest + 1)`` id tensor padded with ``vocab`` (ids
    outside the vocabulary become ``vocab`` too): the column a scatter over it may spoil."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((num_rows, width + 1), vocab, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            padded[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return padded.clamp_(0, vocab).to(device)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
