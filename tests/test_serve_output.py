"""Incremental detokenization (issue #29): the text a request streams equals decoding all its ids
at once, for any ids and any split into steps, stop strings included; and the decoding work per
token is bounded (counted in decoded token ids, never timed), where decoding everything at every
step was quadratic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvoffload.engine import ByteTokenizer, HFTokenizer, RequestOutput
from kvoffload.serving.loop import Delta
from kvoffload.serving.output import MAX_WINDOW_TOKENS, TextAssembler

TOKENIZER = ByteTokenizer(512, 256)
#: Ids a byte-level model samples: ASCII, UTF-8 lead and continuation bytes, EOS, non-bytes.
IDS = st.one_of(
    st.integers(0, 127), st.integers(128, 255), st.sampled_from([0xE2, 0x82, 0xAC, 0xF0, 0x9F]),
    st.integers(256, 511),
)
#: Real multi-byte text, split at every byte.
TEXT_IDS = st.text(min_size=1, max_size=60).map(lambda t: list(t.encode("utf-8")))


class CountingDecode:
    """The tokenizer's decode, counting the ids it was given."""

    def __init__(self) -> None:
        self.calls = 0
        self.ids = 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.calls += 1
        self.ids += len(ids)
        return TOKENIZER.decode(ids)


def _finished(ids: list[int]) -> RequestOutput:
    return RequestOutput("r", [1], ids, "length", None, 1, 0, 0, 0.0, 0.0, 0)


def _run(
    ids: list[int], cuts: list[int], stop: list[str], **options: Any
) -> tuple[str, TextAssembler, bool]:
    """Feed ``ids`` in steps ending at ``cuts``; the text streamed, the assembler, and whether
    a stop string ended it (``options``: the assembler's)."""
    assembler = TextAssembler(TOKENIZER.decode, stop, **options)
    bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    streamed, start = [], 0
    for end in bounds:
        final = end == len(ids)
        piece = assembler.feed(Delta(ids[start:end], [], _finished(ids) if final else None))
        streamed.append(piece.text)
        start = end
        if piece.finish_reason is not None:
            return "".join(streamed), assembler, piece.stopped
    raise AssertionError("no finish")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(IDS, min_size=1, max_size=120), TEXT_IDS),
       st.lists(st.integers(0, 120), max_size=40))
# Found by hypothesis in make test: a character held, then a long delta that completes it and
# ends inside the next one (which was sent as U+FFFD).
@example(list("0\x800000".encode() + "\x80".encode() * 10 + "\u0800\U00010000".encode()), [2, 33])
def test_streamed_text_equals_decoding_everything(ids: list[int], cuts: list[int]) -> None:
    text, assembler, stopped = _run(ids, cuts, [])
    assert text == TOKENIZER.decode(ids) == assembler.text
    assert not stopped and assembler.token_ids == ids


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(IDS, min_size=1, max_size=120), TEXT_IDS),
       st.lists(st.integers(0, 120), max_size=40),
       st.lists(st.text(st.characters(blacklist_characters="\ufffd"), min_size=1, max_size=4),
                min_size=1, max_size=3))
def test_stop_strings_cut_where_full_decoding_finds_them(
    ids: list[int], cuts: list[int], stop: list[str]
) -> None:
    """Stop strings are checked token by token, however the steps group the tokens (no stop
    string holds U+FFFD: a byte token's text then comes a character at a time)."""
    full = TOKENIZER.decode(ids)
    found = _first_stop(full, stop)
    text, _, stopped = _run(ids, cuts, stop)
    # The incomplete character at the very end (U+FFFD, flushed at the finish) may only match
    # a stop string once it is final: as full decoding sees it.
    assert text == (full[: found[0]] if found else full)
    assert stopped == bool(found)


def _first_stop(text: str, stop: list[str], end_after: int = 0) -> tuple[int, str] | None:
    """``(start, stop string)`` of the stop string a token-by-token check meets first in
    ``text``: of those that end past ``end_after`` characters, the one that ends first (ties:
    the one that starts first, then the first listed)."""
    found = [(i + len(s), i, k, s) for k, s in enumerate(stop)
             if (i := text.find(s, max(0, end_after - len(s) + 1))) >= 0]
    return (min(found)[1], min(found)[3]) if found else None


ASCII_IDS = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1,
                    max_size=60).map(lambda t: list(t.encode()))


@settings(max_examples=300, deadline=None)
@given(ASCII_IDS, st.lists(st.integers(0, 60), max_size=20),
       st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 30), st.booleans())
def test_min_tokens_and_include_stop_str_as_vllm(
    ids: list[int], cuts: list[int], stop: list[str], min_tokens: int, include: bool
) -> None:
    """A stop string counts only where it ends past the first ``min_tokens`` tokens' text;
    ``include_stop_str_in_output`` keeps it; ``stop_reason`` names it; the output's tokens end
    with the one that completes it, however the steps group them (ASCII: a token a character)."""
    full = TOKENIZER.decode(ids)
    text, assembler, stopped = _run(ids, cuts, stop, include_stop=include, min_tokens=min_tokens)
    found = _first_stop(full, stop, len(TOKENIZER.decode(ids[:min_tokens])))
    if found is None:
        assert (text, stopped, assembler.stop_reason) == (full, False, None)
        assert assembler.token_ids == ids
    else:
        at, matched = found
        assert text == full[: at + len(matched) if include else at]
        assert stopped and assembler.stop_reason == matched
        assert assembler.token_ids == ids[: at + len(matched)]


def test_tokens_after_a_stop_string_in_the_same_step_are_dropped() -> None:
    """One step of several tokens in which a stop string ends (``;``, the third): the tokens
    after it are neither output nor counted (usage counts :attr:`TextAssembler.token_ids`) nor
    given log-probabilities. Before, all five counted and had log-probabilities."""
    ids = list(b"ab;cd")
    logprobs = [{token: -0.5} for token in ids]
    assembler = TextAssembler(TOKENIZER.decode, [";"])
    piece = assembler.feed(Delta(ids, logprobs))
    assert (piece.text, piece.finish_reason, piece.stopped) == ("ab", "stop", True)
    assert piece.token_ids == assembler.token_ids == list(b"ab;")
    assert piece.logprobs == assembler.logprobs == logprobs[:3]


def test_a_stop_tokens_text_is_left_out_unless_asked() -> None:
    ids = list(b"abc;")
    output = RequestOutput("r", [1], ids, "stop", None, 1, 0, 0, 0.0, 0.0, 0)
    for include, want in ((False, "abc"), (True, "abc;")):
        assembler = TextAssembler(TOKENIZER.decode, [], include_stop=include,
                                  stop_tokens=lambda out: out.output_token_ids[-1])
        assert assembler.feed(Delta(ids, [], output)).text == want
        assert assembler.stop_reason == ord(";")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=40))
def test_token_bytes_are_what_decoding_joins(ids: list[int]) -> None:
    """A token's bytes, joined over any ids, decode to the ids' text (a byte token inside a
    character is its byte, not U+FFFD's three): byte-level ids and byte-level BPE alike."""
    joined = b"".join(TOKENIZER.token_bytes(i) for i in ids)
    assert joined.decode("utf-8", errors="replace") == TOKENIZER.decode(ids)
    bpe_ids = [i % 400 for i in ids]
    joined = b"".join(BPE.token_bytes(i) for i in bpe_ids)
    assert joined.decode("utf-8", errors="replace") == BPE.decode(bpe_ids)


def test_a_long_delta_that_ends_inside_a_character_waits_for_the_rest() -> None:
    """One delta of more than :data:`MAX_WINDOW_TOKENS` ids ending in the first bytes of a
    character, then its last byte: the character is sent whole (before: a U+FFFD, then the
    lone continuation byte's U+FFFD, where full decoding gives the character)."""
    head = [*b"x" * (MAX_WINDOW_TOKENS + 8), 0xE2, 0x82]
    ids = [*head, 0xAC, *b"!"]
    text, _, _ = _run(ids, [len(head)], [])
    assert text == TOKENIZER.decode(ids) == "x" * (MAX_WINDOW_TOKENS + 8) + "\u20ac!"


def test_decoding_work_per_token_is_bounded() -> None:
    """One token per step, 2000 steps: the ids decoded per step stay within a window, whatever
    the text so far (decoding everything each step would decode 2000 * 2001 / 2 ids)."""
    for ids in (list("the quick brown fox €, ünïcode ".encode()) * 50, [0xE2] * 2000):
        decode = CountingDecode()
        assembler = TextAssembler(decode, ["zz"])
        for i, token in enumerate(ids):
            assembler.feed(Delta([token], [], _finished(ids) if i == len(ids) - 1 else None))
        assert decode.calls <= 2 * len(ids) + 2
        assert decode.ids <= 2 * (MAX_WINDOW_TOKENS + 1) * len(ids), decode.ids
        assert assembler.text == TOKENIZER.decode(ids)


def _bpe_tokenizer() -> HFTokenizer:
    """A byte-level BPE tokenizer (as the tiny Llama's), trained here on multi-byte text, so
    that merged tokens end mid-character too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = ["naïve café — €5, ünïcode 😀 text", "the quick brown fox", "日本語のテキスト"] * 50
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return HFTokenizer(tokenizer, eos_token_id=1)


BPE = _bpe_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 399), min_size=1, max_size=80),
       st.lists(st.integers(0, 80), max_size=30))
def test_bpe_streamed_text_equals_decoding_everything(ids: list[int], cuts: list[int]) -> None:
    assembler = TextAssembler(BPE.decode, [])
    bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    streamed, start = [], 0
    for end in bounds:
        final = end == len(ids)
        streamed.append(assembler.feed(Delta(ids[start:end], [],
                                             _finished(ids) if final else None)).text)
        start = end
    assert "".join(streamed) == BPE.decode(ids)
