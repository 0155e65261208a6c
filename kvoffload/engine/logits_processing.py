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
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_token_id: int | None,
) -> torch.Tensor:
    """``logits`` ``(N, vocab)`` as float32 with row ``i`` adjusted by ``params[i]`` given its
    prompt ``prompts[i]`` and the tokens generated so far ``outputs[i]``: while fewer than
    ``min_tokens`` are out, EOS (``eos_token_id``, even with ``ignore_eos``, as vLLM) and the
    stop tokens get ``-inf``; the ``logit_bias`` is added; then the penalties
    (:func:`apply_penalties`). A new tensor; ``logits`` is not changed."""
    out = logits.float().clone()
    vocab = out.shape[1]
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    penalised: list[int] = []
    for i, p in enumerate(params):
        if len(outputs[i]) < p.min_tokens:
            stops = set(p.stop_token_ids)
            if eos_token_id is not None:
                stops.add(eos_token_id)
            ids = [t for t in stops if t < vocab]
            mask_rows += [i] * len(ids)
            mask_ids += ids
        for token, bias in p.logit_bias:
            if token < vocab:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(bias)
        if p.penalised:
            penalised.append(i)
    device = out.device
    if mask_rows:
        out[_index(mask_rows, device), _index(mask_ids, device)] = float("-inf")
    if bias_rows:
        out.index_put_((_index(bias_rows, device), _index(bias_ids, device)),
                       torch.tensor(bias_values, dtype=out.dtype, device=device), accumulate=True)
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
    prompts: Sequence[Sequence[int]],
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
    dtype = logits.dtype
    output_counts = _bin_counts(outputs, num_rows, vocab, logits.device).to(dtype)
    output_seen = output_counts > 0
    seen = output_seen | (_bin_counts(prompts, num_rows, vocab, logits.device) > 0)
    factor = repetition.to(dtype).unsqueeze(1)
    repeated = torch.where(logits > 0, logits / factor, logits * factor)
    out = torch.where(seen, repeated, logits)
    out = out - frequency.to(dtype).unsqueeze(1) * output_counts
    return out - presence.to(dtype).unsqueeze(1) * output_seen.to(dtype)


def _bin_counts(
    rows: Sequence[Sequence[int]], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """``(num_rows, vocab)`` counts of each id in each row (ids outside the vocabulary are not
    counted), by one scatter-add over the rows padded with the id ``vocab``."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((num_rows, width + 1), vocab, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            padded[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    padded = padded.clamp_(0, vocab).to(device)
    counts = torch.zeros((num_rows, vocab + 1), dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
