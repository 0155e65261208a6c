"""What ``kvoffload serve``'s endpoints serve: :class:`ServingContext`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from kvoffload.serving.drain import Drain
from kvoffload.serving.guard import DEFAULT_MAX_REQUEST_BYTES, ApiKey
from kvoffload.serving.loop import EngineLoop
from kvoffload.serving.prompts import PromptTokenizer

__all__ = ["ServingContext"]


@dataclass
class ServingContext:
    """What the endpoints serve: the engine loop, its model's name and limits, the prompt
    tokenizer, the metrics registries, the KV event sources to advertise, and the front door's
    settings (:class:`~kvoffload.serving.guard.RequestGuard`) and its drain on SIGTERM
    (:class:`~kvoffload.serving.drain.Drain`)."""

    loop: EngineLoop
    model_name: str
    max_model_len: int
    tokenizer: PromptTokenizer
    registries: list[CollectorRegistry]
    kv_event_sources: dict[str, Any]
    created: int = 0
    api_key: ApiKey | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    drain: Drain = field(default_factory=Drain)
