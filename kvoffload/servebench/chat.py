"""One streamed chat turn (``/v1/chat/completions``), timed as ``vllm bench serve`` times its
``openai-chat`` backend.

On the client's clock (``perf_counter``): TTFT is the first token chunk minus the send time, ITL
the gaps between later ones, latency the last one minus the send time. A token chunk is one whose
``delta`` carries output (``content``, ``reasoning``, ``tool_calls`` or ``function_call``), or
``content`` ``""`` without ``role``: a token whose text is empty (a special token) or held back
(part of a character); the role-only first chunk vLLM sends (``"content": ""`` with ``role``) is
not one. This is ``vllm bench serve``'s rule, so a turn whose answer is legitimately empty text
succeeds; a 200 stream without a token chunk is a failure. The answer is the concatenated
``content``; output and prompt tokens come from the server's ``usage``
(``stream_options.include_usage``). The
request asks for greedy decoding of exactly ``max_tokens`` tokens (``temperature`` 0,
``ignore_eos``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from kvoffload.routing.connections import Connections
from kvoffload.servebench.client import RequestResult, stream_into

__all__ = ["chat_turn"]


def _is_token_chunk(delta: object) -> bool:
    """Whether a choice's ``delta`` carries a token (the module's rule)."""
    if not isinstance(delta, dict):
        return False
    if any(delta.get(key) for key in ("content", "reasoning", "tool_calls", "function_call")):
        return True
    return delta.get("content") == "" and "role" not in delta


def _fold(out: RequestResult, data: bytes, start: float, last: float) -> float:
    """Fold one SSE payload into ``out``; returns the time of the latest token chunk."""
    msg = json.loads(data)
    if "error" in msg:
        raise ValueError(str(msg["error"].get("message")))
    if (choices := msg.get("choices")) and _is_token_chunk(choices[0].get("delta")):
        now = time.perf_counter()
        if out.ttft == 0.0:
            out.ttft = now - start
        else:
            out.itl.append(now - last)
        out.generated_text += choices[0]["delta"].get("content") or ""
        return now
    if usage := msg.get("usage"):
        out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
    return last


async def chat_turn(
    conns: Connections,
    url: str,
    model: str,
    messages: Sequence[Mapping[str, str]],
    max_tokens: int,
) -> RequestResult:
    """Send ``messages`` and stream the answer; never raises for a failed request (its
    ``error`` says why)."""
    body = {
        "model": model, "messages": list(messages), "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = RequestResult()
    await stream_into(out, conns, f"{url}/v1/chat/completions", body, _fold)
    return out
