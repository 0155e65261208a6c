"""Runs one step's forward pass over the paged KV cache and samples the next tokens."""

from __future__ import annotations

import torch

from kvoffload.engine.attention import AttentionMetadata
from kvoffload.engine.logits_processing import process_logits
from kvoffload.engine.model import DecoderModel
from kvoffload.engine.request import Request
from kvoffload.engine.sampling import make_generator, sample

__all__ = ["ModelRunner"]


class ModelRunner:
    """Owns the model and the engine's KV cache tensor (``model.kv_cache_shape(num_blocks, block_size)``)."""

    def __init__(
        self, model: DecoderModel, num_blocks: int, block_size: int, eos_token_id: int | None = None
    ) -> None:
        self.model = model
        self.eos_token_id = eos_token_id  # masked while a request is under its min_tokens
        self.block_size = block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]]
    ) -> dict[str, tuple[int, dict[int, float] | None]]:
        """Compute ``n`` new tokens of each ``(request, n)``; for every request whose known tokens
        are all computed after this step, returns ``request_id -> (sampled token, logprobs)``
        (logprobs only when its sampling params ask for them).

        Reads ``request.num_computed_tokens`` as the count *before* this step.
        """
        token_ids: list[int] = []
        cached: list[int] = []
        new: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        end = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            token_ids.extend(req.all_token_ids[start : start + n])
            cached.append(start)
            new.append(n)
            tables.append(req.block_ids)
            end += n
            if start + n == req.num_tokens:
                sample_rows.append(end - 1)
                sample_reqs.append(req)
        device = self.model.device
        attn = AttentionMetadata.build(cached, new, tables, self.block_size, device=device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        hidden = self.model(input_ids, attn.positions(), self.kv_cache, attn)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        params = [r.sampling_params for r in sample_reqs]
        generators: list[torch.Generator | None] = []
        for req in sample_reqs:
            if req.generator is None and not req.sampling_params.greedy:
                req.generator = make_generator(req.sampling_params)
            generators.append(req.generator)
        processed = logits
        if any(p.adjusts_logits for p in params):
            vocab, device = logits.shape[1], logits.device
            processed = process_logits(
                logits, params, [() for _ in sample_reqs],
                [r.output_token_ids for r in sample_reqs], self.eos_token_id,
                [r.logits_state(vocab, device) if p.logit_bias or p.penalised else None
                 for r, p in zip(sample_reqs, params, strict=True)],
            )
        tokens = sample(processed, params, generators)
        out: dict[str, tuple[int, dict[int, float] | None]] = {}
        for row, (req, token) in enumerate(zip(sample_reqs, tokens, strict=True)):
            k = req.sampling_params.logprobs  # the model's raw log-probabilities (vLLM's default)
            out[req.request_id] = (token, None if k is None else _logprobs(logits[row], token, k))
        return out


def _logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """Log-probabilities of the ``k`` most likely tokens (all when ``k == -1``) and of ``token``."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    ids = range(lp.shape[0]) if k == -1 else lp.topk(min(k, lp.shape[0])).indices.tolist()
    values = lp.tolist()
    out = {i: values[i] for i in ids}
    out[token] = values[token]
    return out
