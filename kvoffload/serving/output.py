"""Turning a request's token deltas into OpenAI text: incremental decoding, stop strings and
log-probabilities.

Text is decoded incrementally, as vLLM does (:class:`IncrementalDecoder`: a window of tokens from
a prefix offset, its text past the read offset is new), so each token is decoded a bounded number
of times and a character split across tokens comes out whole: while the window's text ends in
U+FFFD (an incomplete UTF-8 sequence) it is held back until the next tokens complete it or the
request ends. While streaming, the last ``len(longest stop string) - 1`` characters are held back
too, so a stop string is never sent before it is recognised; the output ends before the stop
string (OpenAI's rule; vLLM's ``include_stop_str_in_output`` keeps it) and the request is
aborted at once; its tokens end with the one whose text completes the stop string (a step's
later tokens are neither counted in usage nor given log-probabilities). As vLLM: no stop string ends the output before ``min_tokens`` tokens; a stop
token's (or EOS's) own text is left out unless ``include_stop_str_in_output``; ``stop_reason`` is
the stop string or stop token id that ended the request (``None`` for EOS and length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.engine import RequestOutput, SamplingParams
from kvoffload.serving.loop import Delta

__all__ = ["MAX_WINDOW_TOKENS", "IncrementalDecoder", "TextAssembler", "TextPiece",
           "finish_reason_of", "stop_token_of"]

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


def stop_token_of(output: RequestOutput, params: SamplingParams, eos_token_id: int | None) -> (
    int | None
):
    """The stop token id that ended ``output`` (vLLM's ``stop_reason``); ``None`` when it ended
    otherwise, EOS included (EOS is checked first, as vLLM does)."""
    if output.finish_reason != "stop" or not output.output_token_ids:
        return None
    last = output.output_token_ids[-1]
    if last == eos_token_id and not params.ignore_eos:
        return None
    return last if last in params.stop_token_ids else None


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
    per delta is bounded by the delta and the held-back text, never the text sent so far.

    ``include_stop``: a matched stop string (or a stop token's text) stays in the output.
    ``min_tokens``: stop strings count only where they end after that many tokens' text.
    ``stop_tokens``: given the finished output, the stop token id that ended it (``None``
    otherwise); that token's text, or EOS's (``eos_token_id``), is left out unless
    ``include_stop``. ``stop_reason``: the stop string or stop token id that ended it."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str],
        include_stop: bool = False,
        min_tokens: int = 0,
        stop_tokens: Callable[[RequestOutput], int | None] | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self._decoder = IncrementalDecoder(decode)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._stop_token_of = stop_tokens
        self._eos = eos_token_id
        #: A stop string must end past this many characters of output (min_tokens' text).
        self._stop_end_min: float = 0 if min_tokens == 0 else float("inf")
        self._sent_chars = 0
        self.stop_reason: str | int | None = None
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
        ids = delta.token_ids
        if finished is not None:
            self.output = finished
            if self._ends_on_stop_token(finished) and not self._include_stop:
                ids = ids[:-1]  # the stop token's own text is not output (vLLM)
        before = len(self.token_ids) - len(delta.token_ids)
        head = 0
        if before < self._min_tokens <= before + len(ids):
            # min_tokens is reached inside this delta: note where its text ends
            head = self._min_tokens - before
            self._unsent += self._decoder.add(ids[:head])
            self._stop_end_min = self._sent_chars + len(self._unsent)
        found = self._decode_until_stop(delta, ids, head, finished is not None)
        if found is not None:
            cut, stop = found
            self.stop_reason = stop
            return self._emit(cut + len(stop) if self._include_stop else cut, "stop",
                              stopped=True)
        if finished is not None:
            return self._emit(len(self._unsent), finish_reason_of(finished))
        return self._emit(max(0, len(self._unsent) - self._hold), None)

    def _decode_until_stop(
        self, delta: Delta, ids: Sequence[int], start: int, final: bool
    ) -> tuple[int, str] | None:
        """Decode ``ids[start:]`` (of ``delta``) into the held-back text; the first stop string
        found, if any. While a stop string can match, a token at a time: the output ends with
        the token whose text completes the stop string, and the delta's later tokens are
        dropped (neither counted in usage nor given log-probabilities), as if never sampled."""
        step = 1 if self._stop and self._stop_end_min != float("inf") else len(ids)
        at = start
        while True:
            end = min(len(ids), at + max(1, step))
            self._unsent += self._decoder.add(ids[at:end], final=final and end == len(ids))
            found = self._find_stop()
            if found is not None or end == len(ids):
                break
            at = end
        if found is not None:  # the delta's tokens past ``end`` go (``ids`` is a head of them)
            _drop_last(len(delta.token_ids) - end, self.token_ids, self._pending_ids)
            _drop_last(len(delta.logprobs) - end, self.logprobs, self._pending_lps)
        return found

    def _ends_on_stop_token(self, output: RequestOutput) -> bool:
        """Whether EOS or a stop token ended ``output`` (sets :attr:`stop_reason` for the
        latter)."""
        if output.finish_reason != "stop" or not output.output_token_ids:
            return False
        if self._stop_token_of is not None:
            self.stop_reason = self._stop_token_of(output)
        return self.stop_reason is not None or output.output_token_ids[-1] == self._eos

    def _find_stop(self) -> tuple[int, str] | None:
        """Where the first stop string starts in the held-back text, and which (one ending in
        text sent earlier would have been found then: the held-back tail covers every partial
        one); only strings that end past ``min_tokens``' text count."""
        if not self._stop or self._stop_end_min == float("inf"):
            return None
        best: tuple[int, str] | None = None
        floor = self._stop_end_min - self._sent_chars
        for stop in self._stop:
            at = self._unsent.find(stop, max(0, int(floor) - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

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
            self._sent_chars += len(piece.text)
        return piece


def _drop_last(count: int, *lists: list[Any]) -> None:
    """Remove the last ``count`` items of each of ``lists`` (none when ``count`` <= 0)."""
    if count > 0:
        for items in lists:
            del items[len(items) - count :]


#: OpenAI's stand-in for a log-probability of ``-inf`` (JSON has no infinity), as vLLM sends.
MIN_LOGPROB = -9999.0


def _clamped(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, MIN_LOGPROB)


def token_id_key(token: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` form of a token: ``token_id:N``."""
    return f"token_id:{token}"


def completion_logprobs(
    piece: TextPiece, decode: Callable[[Sequence[int]], str], offset: int,
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """``choices[].logprobs`` of the completions API for ``piece``'s tokens. ``top_logprobs``
    is keyed by each token's text; where two tokens decode to the same text, the later one is
    keyed ``token_id:N`` (vLLM's form) so none is lost; ``as_token_ids``: every token so."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, lps in zip(piece.token_ids, piece.logprobs, strict=False):
        text = token_id_key(token) if as_token_ids else decode([token])
        tokens.append(text)
        token_lps.append(_clamped(lps.get(token)))
        top: dict[str, float] = {}
        for t, lp in lps.items():
            key = token_id_key(t) if as_token_ids else decode([t])
            top[token_id_key(t) if key in top else key] = max(lp, MIN_LOGPROB)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    piece: TextPiece, decode: Callable[[Sequence[int]], str], top: int,
    token_bytes: Callable[[int], bytes], as_token_ids: bool = False,
) -> dict[str, Any]:
    """``choices[].logprobs`` of the chat API for ``piece``'s tokens (``top`` alternatives);
    ``bytes`` are each token's own bytes (``token_bytes``: a byte token that is part of a
    character has its byte, not U+FFFD's); ``as_token_ids``: tokens as ``token_id:N``."""

    def entry(token: int, lp: float | None) -> dict[str, Any]:
        return {"token": token_id_key(token) if as_token_ids else decode([token]),
                "logprob": _clamped(lp), "bytes": list(token_bytes(token))}

    content = []
    for token, lps in zip(piece.token_ids, piece.logprobs, strict=False):
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        item = entry(token, lps.get(token))
        item["top_logprobs"] = [entry(t, lp) for t, lp in ranked]
        content.append(item)
    return {"content": content}
