"""Turning a request's token deltas into OpenAI text: incremental decoding, stop strings and
log-probabilities.

Text is decoded from all output ids so far, so a character split across tokens comes out whole:
a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until the next tokens complete it
or the request ends. While streaming, the last ``len(longest stop string) - 1`` characters are
held back too, so a stop string is never sent before it is recognised; the output ends before
the stop string (OpenAI's rule) and the request is aborted at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.engine import RequestOutput
from kvoffload.serving.loop import Delta

__all__ = ["TextAssembler", "TextPiece", "finish_reason_of"]

_REPLACEMENT = "\ufffd"


def finish_reason_of(output: RequestOutput) -> str:
    """OpenAI's finish reason: ``length`` at max_tokens, else ``stop`` (EOS, a stop token or
    string, or an abort)."""
    return "length" if output.finish_reason == "length" else "stop"


@dataclass(slots=True)
class TextPiece:
    """New text (and the token ids and log-probabilities that completed it) ready to send;
    ``finish_reason`` once the request is over; ``stopped`` when a stop string ended it."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped: bool = False


class TextAssembler:
    """Feeds on a request's :class:`Delta` objects, gives back :class:`TextPiece` objects."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.text = ""  # everything sent so far
        self._pending_ids: list[int] = []
        self._pending_lps: list[dict[int, float]] = []
        self.output: RequestOutput | None = None
        self.finish_reason: str | None = None

    def feed(self, delta: Delta) -> TextPiece:
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self._pending_ids.extend(delta.token_ids)
        self._pending_lps.extend(delta.logprobs)
        final = delta.finished is not None
        if final:
            self.output = delta.finished
        full = self._decode(self.token_ids)
        cut = self._find_stop(full)
        if cut is not None:
            return self._emit(full[:cut], "stop", stopped=True)
        if final:
            assert delta.finished is not None
            return self._emit(full, finish_reason_of(delta.finished))
        ready = len(full)
        while ready > len(self.text) and full[ready - 1] == _REPLACEMENT:
            ready -= 1
        ready = max(len(self.text), ready - self._hold)
        return self._emit(full[:ready], None)

    def _find_stop(self, full: str) -> int | None:
        if not self._stop:
            return None
        start = max(0, len(self.text) - self._hold)
        found = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _emit(self, upto: str, finish_reason: str | None, stopped: bool = False) -> TextPiece:
        piece = TextPiece(upto[len(self.text) :], finish_reason=finish_reason, stopped=stopped)
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if piece.text or finish_reason is not None:
            piece.token_ids, self._pending_ids = self._pending_ids, []
            piece.logprobs, self._pending_lps = self._pending_lps, []
        self.text = upto if len(upto) >= len(self.text) else self.text
        return piece


def completion_logprobs(
    piece: TextPiece, decode: Callable[[Sequence[int]], str], offset: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of the completions API for ``piece``'s tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, lps in zip(piece.token_ids, piece.logprobs, strict=False):
        text = decode([token])
        tokens.append(text)
        token_lps.append(lps.get(token))
        tops.append({decode([t]): lp for t, lp in lps.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    piece: TextPiece, decode: Callable[[Sequence[int]], str], top: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of the chat API for ``piece``'s tokens (``top`` alternatives)."""
    content = []
    for token, lps in zip(piece.token_ids, piece.logprobs, strict=False):
        text = decode([token])
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append(
            {
                "token": text,
                "logprob": lps.get(token),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode())}
                    for t, lp in ranked
                ],
            }
        )
    return {"content": content}
