"""Turning a request's token deltas into OpenAI text: incremental decoding, stop strings and
log-probabilities.

Text is decoded incrementally, as vLLM does (:class:`IncrementalDecoder`: a window of tokens from
a prefix offset, its text past the read offset is new), so each token is decoded a bounded number
of times and a character split across tokens comes out whole: while the window's text ends in
U+FFFD (an incomplete UTF-8 sequence) it is held back until the next tokens complete it or the
request ends. While streaming, the last ``len(longest stop string) - 1`` characters are held back
too, so a stop string is never sent before it is recognised; the output ends before the stop
string (OpenAI's rule) and the request is aborted at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.engine import RequestOutput
from kvoffload.serving.loop import Delta

__all__ = ["MAX_WINDOW_TOKENS", "IncrementalDecoder", "TextAssembler", "TextPiece",
           "finish_reason_of"]

_REPLACEMENT = "\ufffd"
#: The most tokens a decoding window holds while its text ends in U+FFFD; past it the U+FFFD is
#: taken as final (a byte that starts no character), so a model that keeps sampling such bytes
#: costs bounded work per token. A character's bytes span at most 4 byte tokens.
MAX_WINDOW_TOKENS = 32
#: The most ids one character's bytes span (UTF-8: 4 bytes, so 4 byte-level tokens at most).
MAX_CHAR_TOKENS = 4


def finish_reason_of(output: RequestOutput) -> str:
    """OpenAI's finish reason: ``length`` at max_tokens, else ``stop`` (EOS, a stop token or
    string, or an abort)."""
    return "length" if output.finish_reason == "length" else "stop"


class IncrementalDecoder:
    """The text of a growing token sequence, decoded a window at a time (vLLM's prefix and read
    offsets). Invariants: ``ids[:read]`` is decoded into :attr:`text` (the pieces returned so
    far); ``prefix <= read`` and the text of ``ids[prefix:read]`` ends on a whole character, so
    the new text is what decoding ``ids[prefix:]`` adds to it. Each :meth:`add` decodes at most
    ``read - prefix + MAX_WINDOW_TOKENS`` tokens twice (a delta that ends inside a character after
    more than that: at most :data:`MAX_CHAR_TOKENS` more times), however long the sequence is;
    the result equals decoding all ids at once whenever no character spans more than
    :data:`MAX_WINDOW_TOKENS` tokens."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        #: ``read`` when the text began to end inside a character (ids held since), else None
        self._waiting_from: int | None = None

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Take ``token_ids``; return the text they complete (``final``: everything left)."""
        ids = self._ids
        ids.extend(token_ids)
        if len(ids) == self._read:
            return ""
        end, new_text = len(ids), self._decode(ids[self._prefix :])
        if not final and new_text.endswith(_REPLACEMENT):
            if self._waiting_from is None and end - self._prefix <= MAX_WINDOW_TOKENS:
                self._waiting_from = self._read
                return ""  # an incomplete character: wait for the tokens that complete it
            if self._waiting_from is not None and end - self._waiting_from <= MAX_WINDOW_TOKENS:
                return ""  # still waiting
            # A long delta, or a long wait: send the head that ends on a whole character
            end, new_text = self._whole_head(new_text)
        self._waiting_from = end if end < len(ids) else None
        prefix_text = self._decode(ids[self._prefix : self._read])
        self._prefix, self._read = self._read, end
        return new_text[len(prefix_text) :]

    def _whole_head(self, text: str) -> tuple[int, str]:
        """``(end, text of ids[prefix:end])`` for the longest head of the ids whose text ends
        on a whole character, holding back at most :data:`MAX_CHAR_TOKENS` unread ids (the
        start of the last character); none: every id, the U+FFFD taken as final (a byte that
        starts no character; ``text`` is the window's text)."""
        ids = self._ids
        for end in range(len(ids) - 1, max(self._read, len(ids) - MAX_CHAR_TOKENS - 1), -1):
            head = self._decode(ids[self._prefix : end])
            if not head.endswith(_REPLACEMENT):
                return end, head
        return len(ids), text


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
    """Feeds on a request's :class:`Delta` objects, gives back :class:`TextPiece` objects. Work
    per delta is bounded by the delta and the held-back text, never the text sent so far."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self._decoder = IncrementalDecoder(decode)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self._sent: list[str] = []  # the pieces' texts so far
        self._unsent = ""  # decoded, held back (at most ``_hold`` characters between deltas)
        self._pending_ids: list[int] = []
        self._pending_lps: list[dict[int, float]] = []
        self.output: RequestOutput | None = None
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return "".join(self._sent)

    def feed(self, delta: Delta) -> TextPiece:
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self._pending_ids.extend(delta.token_ids)
        self._pending_lps.extend(delta.logprobs)
        finished = delta.finished
        if finished is not None:
            self.output = finished
        self._unsent += self._decoder.add(delta.token_ids, final=finished is not None)
        cut = self._find_stop()
        if cut is not None:
            return self._emit(cut, "stop", stopped=True)
        if finished is not None:
            return self._emit(len(self._unsent), finish_reason_of(finished))
        return self._emit(max(0, len(self._unsent) - self._hold), None)

    def _find_stop(self) -> int | None:
        """Where the first stop string starts in the held-back text (one ending in text sent
        earlier would have been found then: the held-back tail covers every partial one)."""
        if not self._stop:
            return None
        found = [i for i in (self._unsent.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _emit(self, upto: int, finish_reason: str | None, stopped: bool = False) -> TextPiece:
        piece = TextPiece(self._unsent[:upto], finish_reason=finish_reason, stopped=stopped)
        self._unsent = "" if finish_reason is not None else self._unsent[upto:]
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if piece.text or finish_reason is not None:
            piece.token_ids, self._pending_ids = self._pending_ids, []
            piece.logprobs, self._pending_lps = self._pending_lps, []
        if piece.text:
            self._sent.append(piece.text)
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
