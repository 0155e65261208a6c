"""How many tokens a server's device KV cache holds, read from the server itself, so that a
sessions run can state how far its conversations outgrow it.

vLLM: ``vllm:cache_config_info``'s ``num_gpu_blocks`` x ``block_size`` labels (``/metrics``).
``kvoffload serve``: the ``kvoffload_device_blocks`` gauge x the engine's block size (from
``/kv_event_sources`` when events are on, else the engine's default,
:data:`KVOFFLOAD_BLOCK_TOKENS`). Summed over the servers behind a router. ``None`` when a server
gives neither (another OpenAI-compatible server) or does not answer.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["KVOFFLOAD_BLOCK_TOKENS", "device_cache_tokens", "device_cache_tokens_of"]

#: ``kvoffload serve``'s default tokens per block (``EngineConfig.block_size``).
KVOFFLOAD_BLOCK_TOKENS = 16


def device_cache_tokens_of(metrics_text: str, block_tokens: int | None = None) -> int | None:
    """The device cache's tokens in one server's ``/metrics`` text (``block_tokens``: a
    ``kvoffload serve``'s block size, when known)."""
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                try:
                    return int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
                except (KeyError, ValueError):
                    return None
            if s.name == "kvoffload_device_blocks":
                return int(s.value) * (block_tokens or KVOFFLOAD_BLOCK_TOKENS)
    return None


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return bytes(resp.read())
    except OSError:
        return None


def _kvoffload_block_tokens(url: str) -> int | None:
    body = _get(f"{url}/kv_event_sources")
    try:
        sources = json.loads(body) if body else {}
        return int(next(iter(sources.values()))["block_size"]) if sources else None
    except (ValueError, KeyError, TypeError, StopIteration):
        return None


def device_cache_tokens(urls: Sequence[str]) -> int | None:
    """The device caches of the servers at ``urls``, in tokens, summed (``None`` when one of
    them does not say)."""
    total = 0
    for url in urls:
        text = _get(f"{url}/metrics")
        if text is None:
            return None
        decoded = text.decode(errors="replace")
        block = _kvoffload_block_tokens(url) if "kvoffload_device_blocks" in decoded else None
        tokens = device_cache_tokens_of(decoded, block)
        if tokens is None:
            return None
        total += tokens
    return total
