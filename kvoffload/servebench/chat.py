"""One streamed chat turn (``/v1/chat/completions``), timed as ``vllm bench serve`` times its
``openai-chat`` backend.

On the client's clock (``perf_counter``): TTFT is the first chunk whose ``delta`` carries
non-empty ``content`` minus the send time (a role-only first chunk, as vLLM sends, is not a
token), ITL the gaps between later such chunks, latency the last such chunk minus the send time;
the answer is the concatenated ``content``; output and prompt tokens come from the server's
``usage`` (``stream_options.include_usage``). An answer without any text (a model whose tokens
all decode to nothing, as the random tiny Llama's often do) is still the server's answer: it is
timed at the chunk that finishes it (``finish_reason``; TTFT = latency) and re-sent empty. A 200
stream with neither content nor a finished choice is a failure. The request asks for greedy decoding of exactly ``max_tokens`` tokens (``temperature`` 0,
``ignore_eos``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from kvoffload.routing.connections import Connections
from kvoffload.servebench.client import RequestResult, stream_into

__all__ = ["chat_turn"]


def _fold(out: RequestResult, data: bytes, start: float, last: float) -> float:
    """Fold one SSE payload into ``out``; returns the time of the latest content chunk."""
    msg = json.loads(data)
    if "error" in msg:
        raise ValueError(str(msg["error"].get("message")))
    if choices := msg.get("choices"):
        content = (choices[0].get("delta") or {}).get("content") or ""
        if content:
            now = time.perf_counter()
            if out.ttft == 0.0:
                out.ttft = now - start
            else:
                out.itl.append(now - last)
            out.generated_text += content
            return now
        if out.ttft == 0.0 and choices[0].get("finish_reason"):  # an answer without text
            now = time.perf_counter()
            out.ttft = now - start
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
