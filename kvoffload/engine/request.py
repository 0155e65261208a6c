"""An engine request: tokens, block hashes, KV progress, status and per-request statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvoffload.engine.logits_processing import LogitsState
from kvoffload.engine.sampling import SamplingParams
from kvoffload.keys import BlockHash, BlockHasher

__all__ = ["Request", "RequestOutput", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued (new, or preempted and waiting to be re-admitted)
    LOADING = "loading"  # blocks allocated, waiting for its KV to load from an offloading tier
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # hit EOS or a stop token
    FINISHED_LENGTH = "length"  # produced max_tokens
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class RequestOutput:
    """The result of one request, with where its prompt's KV came from.

    ``cached_tokens_engine``: prompt tokens served by the engine's own prefix cache;
    ``cached_tokens_offload``: prompt tokens loaded from the offloading tier (both measured at the
    request's first admission). ``ttft`` is seconds from arrival to the first output token.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    text: str | None
    num_prompt_tokens: int
    cached_tokens_engine: int
    cached_tokens_offload: int
    ttft: float
    latency: float
    num_preemptions: int
    #: Seconds between consecutive output tokens (one fewer than the output tokens).
    inter_token_latencies: list[float] = field(default_factory=list)
    #: Per output token, ``token id -> log-probability`` (when ``SamplingParams.logprobs`` is set).
    logprobs: list[dict[int, float]] | None = None


@dataclass(eq=False)
class Request:
    """One request inside the engine. Satisfies :class:`kvoffload.scheduler.OffloadRequest`.

    ``block_hashes`` always covers every full engine block of ``all_token_ids`` (updated as tokens
    are appended); ``num_computed_tokens`` counts tokens whose KV is in the engine's cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    hasher: BlockHasher
    arrival_time: float
    kv_transfer_params: dict[str, Any] | None = None
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks already offered to the engine prefix cache
    num_loading_tokens: int = 0  # tokens an in-flight load will add to num_computed_tokens
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = (
        None  # created on first sampling (see sampling.make_generator)
    )
    # statistics
    cached_tokens_engine: int = -1  # -1: not admitted yet
    cached_tokens_offload: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    inter_token_latencies: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)
    _logits_state: LogitsState | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = self.hasher.hash_blocks(self.all_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    def prompt_tensor(self) -> torch.Tensor:
        """The prompt's ids as a CPU ``long`` tensor, made once (the repetition penalty reads it
        every step)."""
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long)
        return self._prompt_tensor

    def logits_state(self, vocab: int, device: torch.device) -> LogitsState:
        """This request's logit bias and output token counts for logits of ``vocab`` columns on
        ``device``, made once and kept across steps (and preemptions: the output is kept);
        :func:`~kvoffload.engine.logits_processing.process_logits` updates it."""
        state = self._logits_state
        if state is None or not state.fits(vocab, device):
            state = LogitsState(self.sampling_params, self.prompt_tensor(), vocab, device)
            self._logits_state = state
        return state

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token_id: int) -> None:
        """Append a generated token and hash the block it completes, if any."""
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        bs = self.hasher.block_size
        if len(self.all_token_ids) % bs == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(self.hasher.hash_block(parent, self.all_token_ids[-bs:]))
